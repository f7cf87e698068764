"""`python -m infer.profile`: per-width target cost, drafting cost and DLoop round rate on a device.

    presets.py   target shapes (Qwen3-4B / 8B, tiny), memory check, random-weight targets
    measure.py   drafting stage / commit timing, a whole generation's rounds per second
    modeled.py   modeled speedups for given acceptance lengths
    report.py    costs.json (the scheduler's table), profile.json, profile.md
"""

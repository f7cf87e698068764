"""dloop_jax's imports run one way: no import cycle, no import from a lower layer up.

Layers, lowest first (modules of one layer may import each other); the
package's top-level modules (errors, mesh, profiles, ...) are the base below
them all, and the package's own `__init__` (the lazy public API) stands above
them all. Imports inside functions count (they run too), and so does a name
imported from a package's `__init__` (`from dloop_jax.drafters import
build_drafter` runs the whole drafters package), and so do imports under
`if TYPE_CHECKING:`: an annotation that needs a higher layer is a dependency
too (the drafter protocol lives in `decoding`, the engine's contract).
"""

import ast
import pathlib

import dloop_jax

LAYERS = ("models", "decoding", "drafters data", "training")


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
  """{module: the package's modules it imports} of the package in directory `root`."""
  files = {}
  for path in sorted(root.rglob("*.py")):
    parts = path.relative_to(root.parent).with_suffix("").parts
    files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

  def resolve(name):  # "pkg.sub.func" -> "pkg.sub": the module defining it
    while name and name not in files:
      name = name.rpartition(".")[0]
    return name

  graph = {}
  for module, path in files.items():
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
      if isinstance(node, ast.Import):
        names += [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
        names += [f"{base}.{alias.name}" for alias in node.names]
    graph[module] = {resolve(n) for n in names if n.split(".")[0] == root.name} - {module, ""}
  return graph


def import_problems(root: pathlib.Path, layers: tuple[str, ...]) -> list[str]:
  """One line per import cycle and per import from a lower layer up into a higher one."""
  graph = import_graph(root)
  reach = {}
  for start in graph:
    seen, todo = set(), [start]
    while todo:
      for nxt in graph[todo.pop()] - seen:
        seen.add(nxt)
        todo.append(nxt)
    reach[start] = seen
  problems = []
  for cycle in sorted({tuple(sorted(n for n in reach[m] if m in reach[n])) for m in graph
                       if m in reach[m]}):
    edges = "; ".join(f"{m} imports {', '.join(sorted(graph[m] & set(cycle)))}" for m in cycle)
    problems.append(f"import cycle among {', '.join(cycle)}: {edges}")
  rank = {name: i for i, group in enumerate(layers) for name in group.split()}
  layer = {}  # module -> its layer's rank; -1: the base; None: the package's __init__ (top)
  for module in graph:
    top = module.split(".")[1] if "." in module else None
    if top is not None and (root / f"{top}.py").is_file():
      layer[module] = -1
    elif top is not None and top not in rank:
      problems.append(f"{module} is in no layer: add {top!r} to the layers")
    layer.setdefault(module, rank.get(top))
  name = {-1: "base", **dict(enumerate(layers))}
  for module in sorted(graph):
    for imported in sorted(graph[module]):
      low, high = layer[module], layer[imported]
      if low is not None and high is not None and high > low:
        problems.append(f"upward import: {module} (layer {name[low]!r}) imports {imported}"
                        f" (layer {name[high]!r}): move what it needs down to the layer of"
                        f" {module} or lower")
  return sorted(problems)


def test_dloop_jax_imports_run_one_way():
  problems = import_problems(pathlib.Path(dloop_jax.__file__).parent, LAYERS)
  assert not problems, "\n".join(problems)


def test_the_check_reports_cycles_and_upward_imports(tmp_path):
  files = {
      "__init__.py": "from pkg.high import b\n",
      "base.py": "def h():\n  import pkg.low.c\n",
      "low/__init__.py": "",
      "low/a.py": "from .. import base\n\ndef f():\n  from pkg.high import b\n",
      "low/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n  from pkg.high import e\n",
      "high/__init__.py": "",
      "high/b.py": "from ..low import a\nfrom pkg.low.c import f\nimport pkg.base\n",
      "high/e.py": "",
      "other/__init__.py": "from . import d\nVALUE = 1\n",
      "other/d.py": "def g():\n  from pkg.other import VALUE\n",
  }
  for name, text in files.items():
    (tmp_path / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "pkg" / name).write_text(text)
  assert import_graph(tmp_path / "pkg")["pkg.high.b"] == {"pkg.low.a", "pkg.low.c", "pkg.base"}
  assert import_problems(tmp_path / "pkg", ("low", "high")) == [
      "import cycle among pkg.high.b, pkg.low.a:"
      " pkg.high.b imports pkg.low.a; pkg.low.a imports pkg.high.b",
      "import cycle among pkg.other, pkg.other.d: pkg.other imports pkg.other.d;"
      " pkg.other.d imports pkg.other",
      "pkg.other is in no layer: add 'other' to the layers",
      "pkg.other.d is in no layer: add 'other' to the layers",
      "upward import: pkg.base (layer 'base') imports pkg.low.c (layer 'low'): move what it"
      " needs down to the layer of pkg.base or lower",
      "upward import: pkg.low.a (layer 'low') imports pkg.high.b (layer 'high'): move what"
      " it needs down to the layer of pkg.low.a or lower",
      "upward import: pkg.low.c (layer 'low') imports pkg.high.e (layer 'high'): move what"
      " it needs down to the layer of pkg.low.c or lower",  # an annotation's import counts
  ]


def test_the_library_imports_nothing_of_the_commands():
  """dloop_jax is the library under `python -m infer` and `python -m train`, never above them."""
  root = pathlib.Path(dloop_jax.__file__).parent
  found = []
  for path in sorted(root.rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
      found += [f"{path.relative_to(root)}: {n}" for n in names
                if n.split(".")[0] in ("infer", "train")]
  assert not found, found

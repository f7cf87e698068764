"""`models.int8_hlo` on handwritten optimized HLO of the forms GPU and TPU compilers give a
weight-only int8 product (`convert -> dot`), so that the reading a device check relies on is
tested without a device; XLA:CPU's own programs are read in tests/test_int8.py."""

from __future__ import annotations

import pytest

from dloop_jax import hlo_text
from dloop_jax.models import int8_hlo

# A product x [16, 4096] bf16 times an int8 weight [4096, 6144], then x channel scale.
W = 4096 * 6144
_HEAD = """HloModule jit_product, is_scheduled=true, \
entry_computation_layout={(bf16[16,4096]{1,0}, s8[4096,6144]{1,0}, f32[6144]{0})->f32[16,6144]{1,0}}

%fused_multiply (param_0.1: f32[16,6144], param_1.1: f32[6144]) -> f32[16,6144] {
  %param_0.1 = f32[16,6144]{1,0} parameter(0)
  %param_1.1 = f32[6144]{0} parameter(1)
  %broadcast.1 = f32[16,6144]{1,0} broadcast(%param_1.1), dimensions={1}
  ROOT %multiply.1 = f32[16,6144]{1,0} multiply(%param_0.1, %broadcast.1)
}
"""
_PARAMS = """  %x.1 = bf16[16,4096]{1,0} parameter(0), metadata={op_name="x"}
  %w.1 = s8[4096,6144]{1,0} parameter(1), metadata={op_name="w"}
  %s.1 = f32[6144]{0} parameter(2), metadata={op_name="s"}
"""
_CONFIG = '"operation_queue_id":"0","wait_on_operation_queues":[]'


def _module(computations: str, entry: str) -> str:
  return (_HEAD + computations + "\nENTRY %main.4 (x.1: bf16[16,4096], w.1: s8[4096,6144],"
          " s.1: f32[6144]) -> f32[16,6144] {\n" + _PARAMS + entry + "\n}\n")


def _scaled(product: str) -> str:
  return (f"  ROOT %loop_multiply_fusion = f32[16,6144]{{1,0}} fusion(%{product}, %s.1),"
          " kind=kLoop, calls=%fused_multiply")


# XLA:GPU's Triton GEMM fusion (the legacy emitter): the convert inside the fusion's body.
TRITON_GEMM = _module("""
%triton_gemm_dot_general.0_computation (parameter_0: bf16[16,4096], parameter_1: s8[4096,6144]) \
-> f32[16,6144] {
  %parameter_0 = bf16[16,4096]{1,0} parameter(0)
  %parameter_1 = s8[4096,6144]{1,0} parameter(1)
  %convert_element_type.1 = bf16[4096,6144]{1,0} convert(%parameter_1), \
metadata={op_name="jit(product)/convert_element_type"}
  ROOT %dot_general.1 = f32[16,6144]{1,0} dot(%parameter_0, %convert_element_type.1), \
lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(product)/dot_general"}
}
""", f"""  %triton_gemm_dot_general.0 = f32[16,6144]{{1,0}} fusion(%x.1, %w.1), kind=kCustom, \
calls=%triton_gemm_dot_general.0_computation, metadata={{op_name="jit(product)/dot_general"}}, \
backend_config={{{_CONFIG},"fusion_backend_config":{{"kind":"__triton_gemm","triton_gemm_config":\
{{"block_m":"16","block_n":"128","block_k":"128","split_k":"1","num_stages":"4","num_warps":"4",\
"num_ctas":"1"}}}},"force_earliest_schedule":false}}
""" + _scaled("triton_gemm_dot_general.0"))

# The generic Triton emitter: each operand of the dot through a nested fusion of its own.
NESTED_TRITON = _module("""
%fusion_lhs (parameter_0.2: bf16[16,4096]) -> bf16[16,4096] {
  ROOT %parameter_0.2 = bf16[16,4096]{1,0} parameter(0)
}

%fusion_rhs (parameter_0.3: s8[4096,6144]) -> bf16[4096,6144] {
  %parameter_0.3 = s8[4096,6144]{1,0} parameter(0)
  ROOT %convert.3 = bf16[4096,6144]{1,0} convert(%parameter_0.3)
}

%gemm_fusion_dot.1_computation (parameter_0: bf16[16,4096], parameter_1: s8[4096,6144]) \
-> f32[16,6144] {
  %parameter_0 = bf16[16,4096]{1,0} parameter(0)
  %lhs = bf16[16,4096]{1,0} fusion(%parameter_0), kind=kCustom, calls=%fusion_lhs, \
backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %parameter_1 = s8[4096,6144]{1,0} parameter(1)
  %rhs = bf16[4096,6144]{1,0} fusion(%parameter_1), kind=kCustom, calls=%fusion_rhs, \
backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  ROOT %dot.1 = f32[16,6144]{1,0} dot(%lhs, %rhs), lhs_contracting_dims={1}, \
rhs_contracting_dims={0}
}
""", f"""  %gemm_fusion_dot.1 = f32[16,6144]{{1,0}} fusion(bf16[16,4096]{{1,0}} %x.1, \
s8[4096,6144]{{1,0}} %w.1), kind=kCustom, calls=%gemm_fusion_dot.1_computation, \
backend_config={{{_CONFIG},"fusion_backend_config":{{"kind":"__triton_gemm",\
"block_level_fusion_config":{{"output_tiles":[{{"sizes":["16","64"]}}],"num_warps":"4"}}}}}}
""" + _scaled("gemm_fusion_dot.1"))

# cuBLAS chosen by the autotuner: a kLoop fusion writes the converted weight, then the gemm
# custom call (whose result holds an s8 workspace larger than the weight: not a weight).
CUBLAS = _module("""
%fused_convert (param_0: s8[4096,6144]) -> bf16[4096,6144] {
  %param_0 = s8[4096,6144]{1,0} parameter(0)
  ROOT %convert.2 = bf16[4096,6144]{1,0} convert(%param_0)
}
""", f"""  %loop_convert_fusion = bf16[4096,6144]{{1,0}} fusion(%w.1), kind=kLoop, \
calls=%fused_convert, backend_config={{{_CONFIG}}}
  %custom-call.1 = (f32[16,6144]{{1,0}}, s8[33554432]{{0}}) custom-call(%x.1, \
%loop_convert_fusion), custom_call_target="__cublas$gemm", backend_config={{{_CONFIG},\
"gemm_backend_config":{{"alpha_real":1,"beta":0,"dot_dimension_numbers":\
{{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],\
"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}},"epilogue":"DEFAULT"}}}}
  %get-tuple-element.1 = f32[16,6144]{{1,0}} get-tuple-element(%custom-call.1), index=0
  %get-tuple-element.2 = s8[33554432]{{0}} get-tuple-element(%custom-call.1), index=1
  %copy.9 = s8[33554432]{{0}} copy(%get-tuple-element.2)
""" + _scaled("get-tuple-element.1"))

# A TPU-like fusion: the dot written as a convolution, the convert in its body.
TPU = _module("""
%fused_computation.1 (param_0: bf16[16,4096], param_1: s8[4096,6144]) -> f32[16,6144] {
  %param_0 = bf16[16,4096]{1,0:T(8,128)(2,1)} parameter(0)
  %param_1 = s8[4096,6144]{1,0:T(8,128)(4,1)} parameter(1)
  %convert.1 = bf16[4096,6144]{1,0:T(8,128)(2,1)} convert(s8[4096,6144]{1,0:T(8,128)(4,1)} \
%param_1)
  ROOT %convolution.1 = f32[16,6144]{1,0:T(8,128)} convolution(%param_0, %convert.1), \
dim_labels=bf_io->bf
}
""", """  %fusion.1 = f32[16,6144]{1,0:T(8,128)} fusion(%x.1, %w.1), kind=kOutput, \
calls=%fused_computation.1
""" + _scaled("fusion.1"))


def test_a_convert_inside_a_triton_gemm_fusion_is_a_product_reading_int8():
  reads = int8_hlo.weight_reads(TRITON_GEMM, min_elements=W)
  assert reads == int8_hlo.WeightReads(weights=1, products=1, rows=0, whole=(), other=(),
                                       kernels={"__triton_gemm": 1})


def test_a_convert_in_a_nested_operand_fusion_of_the_gemm_is_inside_it_too():
  reads = int8_hlo.weight_reads(NESTED_TRITON, min_elements=W)
  assert (reads.products, reads.whole, reads.other) == (1, (), ())
  assert reads.kernels == {"__triton_gemm": 1}


def test_a_convert_fusion_writing_the_weight_before_a_cublas_gemm_is_listed_whole():
  reads = int8_hlo.weight_reads(CUBLAS, min_elements=W)
  # The weight is written as bf16 [K, N] first; the gemm reads that, not the int8 bytes. The
  # gemm's s8 workspace (larger than the weight, copied) is no weight.
  assert reads.weights == 1 and reads.products == 0 and not reads.other
  assert reads.whole == ("loop_convert_fusion = bf16[4096,6144]{1,0} fusion(w.1) [kLoop]",)


def test_a_gemm_library_call_taking_the_int8_array_itself_reads_it_as_stored():
  direct = "\n".join(line for line in CUBLAS.splitlines()
                     if not line.startswith("  %loop_convert_fusion ="))
  direct = direct.replace("custom-call(%x.1, %loop_convert_fusion)", "custom-call(%x.1, %w.1)")
  reads = int8_hlo.weight_reads(direct, min_elements=W)
  assert (reads.products, reads.whole, reads.kernels) == (1, (), {"__cublas$gemm": 1})


def test_a_tpu_fusion_converting_into_its_convolution_is_a_product():
  reads = int8_hlo.weight_reads(TPU, min_elements=W)
  assert (reads.products, reads.whole, reads.kernels) == (1, (), {"kOutput": 1})


def test_weights_are_followed_through_views_loops_and_calls_and_copies_are_whole():
  square = TRITON_GEMM.replace("4096,6144", "4096,4096").replace("16,6144", "16,4096").replace(
      "f32[6144]", "f32[4096]")
  body, gemm = square.split("\nENTRY ")
  gemm_line = next(line for line in gemm.splitlines() if "fusion(%x.1, %w.1)" in line)
  looped = body + """
%body (p: (s32[], bf16[16,4096], s8[4096,4096])) -> (s32[], bf16[16,4096], s8[4096,4096]) {
  %p = (s32[], bf16[16,4096]{1,0}, s8[4096,4096]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x.1 = bf16[16,4096]{1,0} get-tuple-element(%p), index=1
  %w.1 = s8[4096,4096]{1,0} get-tuple-element(%p), index=2
""" + gemm_line.replace("f32[16,4096]", "bf16[16,4096]") + """
  ROOT %t = (s32[], bf16[16,4096]{1,0}, s8[4096,4096]{1,0}) tuple(%i, \
%triton_gemm_dot_general.0, %w.1)
}

%called (a: bf16[16,4096], b: s8[4096,4096]) -> f32[16,4096] {
  %a = bf16[16,4096]{1,0} parameter(0)
  %b = s8[4096,4096]{1,0} parameter(1)
  %view = s8[4096,4096]{0,1} bitcast(%b)
""" + gemm_line.replace("%x.1, %w.1", "%a, %view") + """
}

ENTRY %main (x: bf16[16,4096], w: s8[4096,4096]) -> f32[16,4096] {
  %x = bf16[16,4096]{1,0} parameter(0)
  %w = s8[4096,4096]{1,0} parameter(1)
  %zero = s32[] constant(0)
  %tuple = (s32[], bf16[16,4096]{1,0}, s8[4096,4096]{1,0}) tuple(%zero, %x, %w)
  %while = (s32[], bf16[16,4096]{1,0}, s8[4096,4096]{1,0}) while(%tuple), condition=%cond, \
body=%body
  %call = f32[16,4096]{1,0} call(%x, %w), to_apply=%called
  ROOT %transposed = s8[4096,4096]{0,1} copy(%w)
}
"""
  reads = int8_hlo.weight_reads(looped, min_elements=4096 * 4096)
  # One weight given; read as stored in the loop body and in the called computation; the
  # layout copy writes it whole (in s8, but whole).
  assert (reads.weights, reads.products, reads.kernels) == (1, 2, {"__triton_gemm": 2})
  assert reads.whole == ("transposed = s8[4096,4096]{0,1} copy(w)",)


def test_one_row_products_as_reduces_count_and_embedding_rows_do_not():
  module = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%fused_gemv (param_0: bf16[4096], param_1: s8[4096,6144]) -> f32[6144] {
  %param_1 = s8[4096,6144]{1,0} parameter(1)
  %convert.5 = f32[4096,6144]{1,0} convert(%param_1)
  %param_0 = bf16[4096]{0} parameter(0)
  %convert.6 = f32[4096]{0} convert(%param_0)
  %broadcast.2 = f32[4096,6144]{1,0} broadcast(%convert.6), dimensions={0}
  %multiply.2 = f32[4096,6144]{1,0} multiply(%convert.5, %broadcast.2)
  %constant.1 = f32[] constant(0)
  ROOT %reduce.1 = f32[6144]{0} reduce(%multiply.2, %constant.1), dimensions={0}, to_apply=%add
}

%fused_embed (param_0: s8[6144,4096], param_1: s32[16,1]) -> f32[16] {
  %param_0 = s8[6144,4096]{1,0} parameter(0)
  %param_1 = s32[16,1]{1,0} parameter(1)
  %gather.1 = s8[16,4096]{1,0} gather(%param_0, %param_1), offset_dims={1}, \
collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,4096}
  %convert.7 = f32[16,4096]{1,0} convert(%gather.1)
  %square = f32[16,4096]{1,0} multiply(%convert.7, %convert.7)
  %constant.2 = f32[] constant(0)
  ROOT %norm = f32[16]{0} reduce(%square, %constant.2), dimensions={1}, to_apply=%add
}

ENTRY %main (x: bf16[4096], w: s8[4096,6144], table: s8[6144,4096], ids: s32[16,1], \
codes: s8[16,4096]) -> f32[6144] {
  %x = bf16[4096]{0} parameter(0)
  %w = s8[4096,6144]{1,0} parameter(1)
  %table = s8[6144,4096]{1,0} parameter(2)
  %ids = s32[16,1]{1,0} parameter(3)
  %codes = s8[16,4096]{1,0} parameter(4)
  %rows = f32[16]{0} fusion(%table, %ids), kind=kInput, calls=%fused_embed
  %codes_copy = s8[16,4096]{1,0} copy(%codes)
  ROOT %gemv = f32[6144]{0} fusion(%x, %w), kind=kInput, calls=%fused_gemv
}
"""
  reads = int8_hlo.weight_reads(module, min_elements=W)
  # The norm's reduce after a gather of rows is no product; s8 activation codes (smaller
  # than any weight) are no weight, copied or not.
  assert reads == int8_hlo.WeightReads(weights=2, products=1, rows=1, whole=(), other=(),
                                       kernels={"kInput": 1})


@pytest.mark.parametrize("line, operands", [
    ("  %f = f32[2]{0} fusion(%a, %b.1), kind=kLoop, calls=%c, metadata={op_name=\"f(x, y)\"}",
     ("a", "b.1")),
    ("  ROOT %g = (f32[2]{0}, s8[4]{0}) custom-call(f32[2,3]{1,0} %a, s8[3]{0:T(8)(4,1)} %b),"
     " custom_call_target=\"__cublas$gemm\"", ("a", "b")),
    ("  %h = f32[1]{0} fusion(%a, %b, %c, %d, %e, /*index=5*/%f), kind=kLoop, calls=%k",
     ("a", "b", "c", "d", "e", "f")),
    ("  %p = s8[4,4]{1,0} parameter(1)", ()),
])
def test_instructions_are_parsed_with_their_operands(line, operands):
  inst = hlo_text.parse(line)
  assert inst is not None and inst.operands == operands
  assert inst.root == line.lstrip().startswith("ROOT")

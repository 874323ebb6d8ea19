// The Python module of Tandem's native CPU kernels (loaded by worker/native.py).
#include <torch/extension.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention");
  m.def("rms_norm", &rms_norm, "RMSNorm rows (llama or gemma style)");
  m.def("write_kv", &write_kv, "write a step's K and V rows into their cache slots");
  m.def("rotary_", &rotary_, "rotary embedding in place on the first heads");
  m.def("act_mul", &act_mul, "act(gate) * up of a fused gate_up projection (0 silu, 1 gelu tanh)");
  m.def("add_rms_norm", &add_rms_norm, "residual add, then RMSNorm; returns (sum, normed)");
  m.def("apply_token_bitmask_", &apply_token_bitmask_,
        "structured outputs: -inf where a token's mask bit is clear, in place");
  m.def("argmax_rows", &argmax_rows,
        "each row's first maximum (greedy sampling), read in the logits' own dtype");
  m.def("has_bf16_gemv", &has_bf16_gemv, "whether bf16_gemv was built (AVX512-BF16)");
  m.def("bf16_gemv_max_rows", &bf16_gemv_max_rows,
        "the most rows bf16_gemv takes for a weight of this shape (0: none)",
        py::arg("out_features"), py::arg("in_features"));
  m.def("bf16_gemv", &bf16_gemv, "x W^T + b for a few bfloat16 rows, streaming W",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none());
  m.def("has_amx_linear", &has_amx_linear, "whether amx_linear runs here (AMX-BF16 and leave)");
  m.def("has_bf16_prefill_attention", &has_bf16_prefill_attention,
        "whether prefill_attention was built (AVX512-BF16)");
  m.def("prefill_attention", &prefill_attention,
        "causal attention of one bfloat16 prefill chunk after `offset` cached tokens "
        "(window 0: none)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("offset"), py::arg("scale"),
        py::arg("window"));
  m.def("prefill_attention_chunks_", &prefill_attention_chunks_,
        "causal attention of a step's fresh bfloat16 prefill chunks (no cached prefix) in one "
        "call: chunk c is rows [starts[c], ends[c]) of q, k and v, its result those rows of out",
        py::arg("out"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("starts"),
        py::arg("ends"), py::arg("scale"), py::arg("window"));
  m.def("has_bf16_gemm", &has_bf16_gemm, "whether bf16_gemm was built (AVX512-BF16)");
  m.def("bf16_gemm_packs", &bf16_gemm_packs,
        "whether bfloat16 projections past the GEMV's rows go to bf16_gemm (not oneDNN) here");
  m.def("bf16_gemm_pack", &bf16_gemm_pack, "a bfloat16 [out, in] weight in bf16_gemm's layout",
        py::arg("weight"));
  m.def("bf16_gemm", &bf16_gemm, "x W^T + b for bfloat16 rows, W from bf16_gemm_pack",
        py::arg("x"), py::arg("packed"), py::arg("bias") = py::none());
  m.def("gguf_dequantize", &gguf_dequantize,
        "GGUF blocks [out, row_bytes] to float32 (or bfloat16) [out, in]", py::arg("weight"),
        py::arg("type"), py::arg("in_features"), py::arg("bfloat16") = false);
  m.def("gguf_bf16_matmul", &gguf_bf16_matmul,
        "x W^T + b for many bfloat16 rows, W as GGUF blocks dequantized to bfloat16 a group "
        "at a time for bf16_gemm; bfloat16 out",
        py::arg("x"), py::arg("weight"), py::arg("type"), py::arg("bias") = py::none());
  m.def("gguf_linear", &gguf_linear,
        "x W^T + b for float32 or bfloat16 rows, W as GGUF blocks (and, for bfloat16 rows "
        "from gguf_gemm_min_rows, as gguf_gemm_pack repacked them); float32 out, or (bf16_out) "
        "bfloat16 rounded once from it",
        py::arg("x"), py::arg("weight"), py::arg("type"), py::arg("bias") = py::none(),
        py::arg("packed") = py::none(), py::arg("bf16_out") = false,
        py::arg("q8_activations") = false);
  m.def("gguf_quantize_q8", &gguf_quantize_q8,
        "rows quantized as gguf_linear's 8-bit activations: (q int8 [rows, in], d float32 "
        "[rows, in / 32]), x ~ d q per block of 32",
        py::arg("x"));
  m.def("gguf_gemm_packs", &gguf_gemm_packs,
        "whether this build repacks this GGUF type for bfloat16 rows from gguf_gemm_min_rows "
        "(AVX512-BF16, 32-weight formats)",
        py::arg("type"));
  m.def("gguf_gemm_min_rows", &gguf_gemm_min_rows,
        "the fewest bfloat16 rows gguf_linear runs on a repacked copy of this type's quants",
        py::arg("type"));
  m.def("gguf_gemm_pack", &gguf_gemm_pack,
        "GGUF blocks [out, row_bytes] repacked for gguf_linear's bfloat16 GEMM",
        py::arg("weight"), py::arg("type"), py::arg("in_features"));
  m.def("gguf_has_bf16_rows", &gguf_has_bf16_rows,
        "whether gguf_linear dots this many bfloat16 rows with this type's quants as they are "
        "(AVX512-BF16, Q4/Q5 formats, 1-2 rows) rather than converting them to float32",
        py::arg("type"), py::arg("rows"));
  m.def("int8_linear_isas", &int8_linear_isas,
        "the int8 kernels' ISA paths built here (0 portable, 1 AVX2, 2 AVX-VNNI, 3 AVX512-VNNI, "
        "4 AMX-INT8)");
  m.def("int8_pack", &int8_pack, "an int8 [out, in] weight in int8_linear's panels",
        py::arg("qweight"));
  m.def("int8_quantize_rows", &int8_quantize_rows,
        "rows to int8 per row (symmetric, max|x| / 127, nearest even), in padded to 4: "
        "(int8 [rows, padded in], float32 scales [rows])",
        py::arg("x"));
  m.def("int8_matmul_int32", &int8_matmul_int32,
        "the exact int32 products of quantized rows with a packed int8 weight",
        py::arg("xq"), py::arg("packed"), py::arg("weight_sums"), py::arg("isa") = -1);
  m.def("int8_linear", &int8_linear,
        "W8A8 x W^T + b: rows quantized per row, int32 sums, float(acc) * (s_x * s_w) + b, "
        "out in x's dtype",
        py::arg("x"), py::arg("packed"), py::arg("weight_sums"), py::arg("weight_scales"),
        py::arg("bias") = py::none(), py::arg("isa") = -1);
  m.def("decode_layers", &decode_layers,
        "a decode step through every layer of a llama-shaped model");
  m.def("decode_rows_max_rows", &decode_rows_max_rows,
        "the most rows decode_rows takes here on bf16_gemm (gemm) or the GEMV (0: no "
        "AVX512-BF16, no decode_rows)",
        py::arg("gemm"));
  py::class_<DecodeRowsPlan>(m, "DecodeRowsPlan",
                             "decode_layers on raw rows for one model's steps: any rows on "
                             "bf16_gemm, one or two on the GEMV, GGUF projections on "
                             "gguf_linear, or int8 ones on int8_linear; its weights and "
                             "caches checked once")
      .def(py::init<std::vector<at::Tensor>, std::vector<at::Tensor>, bool,
                    std::vector<std::optional<at::Tensor>>, std::vector<int64_t>,
                    std::vector<at::Tensor>, const std::vector<int64_t>&, bool,
                    std::vector<at::Tensor>, std::vector<at::Tensor>, bool, bool, bool, int64_t, std::vector<at::Tensor>, std::vector<int64_t>,
                    std::vector<int64_t>, int64_t, int64_t, int64_t, int64_t, double, double,
                    at::Tensor, double, at::Tensor>())
      .def("run", &DecodeRowsPlan::run,
           "a decode step of these token ids through the embedding, every layer and the "
           "final norm",
           py::arg("ids"), py::arg("slots"), py::arg("block_table"), py::arg("context_lens"),
           py::arg("cos"), py::arg("sin"), py::arg("phase_seconds"));
  m.def("decode_rows_phases", &decode_rows_phases,
        "the phases of decode_rows' step, in the order its phase_seconds holds them");
  m.def("lora_sgmv_", &lora_sgmv_,
        "LoRA deltas of each group's adapter added in place to its rows of y (SGMV)",
        py::arg("y"), py::arg("x"), py::arg("rows"), py::arg("group_starts"), py::arg("a"),
        py::arg("bt"), py::arg("blocks"), py::arg("scales"));
  m.def("parallel_steal_trace", &parallel_steal_trace,
        "tandem::parallel_steal over tasks that wait costs_us[i] microseconds: [tasks, 2] of "
        "(times run, thread that ran it)",
        py::arg("costs_us"));
}

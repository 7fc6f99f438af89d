"""Weight-only quantization at load: int8, int4, GGUF Q4 blocks, compressed-tensors.

``plan.resolve_plan`` decides what ``actors.load.loader.load_model`` does for a
``quantization`` setting and a checkpoint; the kernels and quantizers are in
``actors.model.models.quant_linear``, the GGUF block reader in
``actors.load.gguf.q4_blocks``, the compressed-tensors reader in
``actors.load.quant.compressed_tensors``.

What it costs in accuracy, measured on SmolLM2-135M-Instruct (the
``smollm2-135m`` preset, Q4_1 linears, Q8_0 tied embedding), float32 model:

* GGUF Q4 scales and zeros are fp16; the int4 kernel takes them in bfloat16.
  That rounding alone (float32 arithmetic otherwise) moves each linear weight
  by at most 0.3% of the layer's largest weight and the logits of three chat
  prompts by 1.1% of the largest logit (top-1 agreement 97-100% over the
  prompt positions).
* Everything together (bfloat16 activations inside the quantized linears,
  bfloat16 scales, the int8 head with its top logits recomputed in float32):
  logits within 2.3% of the largest (median over 192 decode positions of six
  chat prompts, teacher-forced on the float32 greedy path; 3.7% at most) and
  3 top-1 flips of 192 for ``int4``. ``int8`` requantizes the dequantized
  Q4_1 weights per output channel, which is coarser than the Q4_1 groups on
  rows with outliers: 3.8% (9.1% at most), 10 flips of 192.
"""

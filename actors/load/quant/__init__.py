"""Weight-only quantization at load: int8, int4, GGUF Q4 blocks, compressed-tensors.

``plan.resolve_plan`` decides what ``actors.load.loader.load_model`` does for a
``quantization`` setting and a checkpoint; the kernels and quantizers are in
``actors.models.quant_linear``, the GGUF block reader in
``actors.load.gguf.q4_blocks``, the compressed-tensors reader in
``actors.load.quant.compressed_tensors``.

Where the accuracy is lost: GGUF Q4 scales and zeros are fp16, and the int4
kernel takes them in bfloat16; the quantized linears run bfloat16
activations; the int8 head recomputes its top logits in float32. ``int8``
requantizes the dequantized Q4_1 weights per output channel, which is coarser
than the Q4_1 groups on rows with outliers. What that costs against the
float32 model (top-1 agreement, perplexity) is measured by ``flotilla bench
accuracy`` and set out in docs/quantization.md.
"""

"""The CPU fast path of the HF rollout engine: a decode step for llama/mistral/qwen2 with fused fp32
kernels (`fast_decode.py`; `cpu_kernels.py` builds and binds `decode_kernels.c`). It runs only where
`FastDecoder.usable()` holds (fp32 on CPU, no autocast, no module hooks); the C kernels also honour
POSTTRAIN_CPU_KERNELS=0. Everything else decodes through transformers' forward."""

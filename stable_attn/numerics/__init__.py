"""Numerics lab: measure the rounding bias the fix removes, in controlled inputs and in real models.

- :mod:`.bf16`: one BF16 addition bit by bit (the paper's ``-2.40625 + -2.296875``);
- :mod:`.bias`: mean signed error, t-statistic and RMS error in units of one bf16 rounding;
- :mod:`.arithmetic`: arithmetic models of ``softmax(s) V`` (our kernel, the published all-bf16
  blockwise code, sequential bf16 accumulation) and their exact answer (built on
  :mod:`stable_attn.kernels.naive`, the one fp64 oracle); used by benchmarks/bias_study.py;
- :mod:`.tensor_core`: bit-level models of one A100/H100/B200 tensor-core MMA (``mma``), after Fasi et al.
  (2021), Khattak & Mikaitis (2025) and MMA-Sim, with an IEEE fp32 reference; arithmetic model (d) runs the
  kernel's ``P-bar V`` on them;
- :mod:`.paper_attention`: the published all-BF16 flash attention, forward and backward, as a training op
  (model b; benchmarks/tensor_core_training.py's positive control);
- :mod:`.probe`: the per-layer probe of a transformers model (``stable-attn probe``; ``--arithmetic h100``
  replays it on the tensor-core models through :func:`.arithmetic.tensor_core_attention`).
"""

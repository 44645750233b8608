"""The GPU tier's case tables, in one place: the GPU tests (tests/gpu/) run them, and tests/_builds.py maps them to the
kernel builds the launchers pick for them, which the CPU tier compiles (tests/cpu/test_compile_tier.py) and
bench/precompile.py carries to the GPU machine.
"""
from __future__ import annotations

import dataclasses

import torch
from _helpers import Case, random_lengths


@dataclasses.dataclass(frozen=True)
class FwdCase:
    """A `chunk_fwd` stage case (tests/gpu/test_fwd.py)."""
    name: str
    seqlens: tuple
    H: int
    HV: int
    K: int = 128
    V: int = 128
    pad: int = 0
    dtype: torch.dtype = torch.bfloat16
    beta_dtype: torch.dtype = torch.bfloat16
    h0: bool = True
    h0_dtype: torch.dtype = torch.float32
    state_v_first: bool = False
    gate: str = "model"

    def __str__(self):
        return self.name


FWD_EDGES = (1, 0, 63, 64, 65, 200, 130, 0, 127, 129)
FWD_CASES = [
    FwdCase("edges-gva2-h0-pad37", FWD_EDGES, H=2, HV=4, pad=37),
    FwdCase("edges-gva1-fp16-noh0-vfirst", FWD_EDGES, H=4, HV=4, pad=5, dtype=torch.float16,
            beta_dtype=torch.float32, h0=False, state_v_first=True),
    FwdCase("gva4-h0bf16-vfirst", (300, 1, 129), H=1, HV=4, h0_dtype=torch.bfloat16, beta_dtype=torch.float32,
            state_v_first=True),
    FwdCase("empty-only-pad10", (0,), H=2, HV=2, pad=10),
    FwdCase("bench-gate-gva4", (4096, 1000), H=2, HV=8, gate="bench", beta_dtype=torch.float32),
    FwdCase("zero-gate", (129, 64), H=2, HV=2, gate="zero"),
    FwdCase("k64-v64", (100, 64, 3), H=2, HV=4, K=64, V=64, pad=9),
    FwdCase("v256", (100, 64, 3), H=2, HV=4, V=256, pad=9, dtype=torch.float16, beta_dtype=torch.float16),
    FwdCase("long-32k", (32768,), H=2, HV=4),
]
FWD_MANY_SEQS = FwdCase("70k-seqs", random_lengths(70000, (0, 1, 2, 3, 65), 3), H=1, HV=2, pad=10, h0=False)
FWD_DET = FwdCase("det", (5000, 77, 1), H=2, HV=8, pad=3)
FWD_GRAPH = FwdCase("graph", (300, 64), H=2, HV=4)
# test_offsets_past_2_31_elements (prepare and the fused kernel): heads, dims and dtypes; its inputs are built there
FWD_BIG = FwdCase("2^31", (), H=16, HV=64, beta_dtype=torch.float32)
FWD_ALL = FWD_CASES + [FWD_MANY_SEQS, FWD_DET, FWD_GRAPH, FWD_BIG]


@dataclasses.dataclass(frozen=True)
class PrepCase:
    """A `prepare` stage case (tests/gpu/test_prepare.py)."""
    name: str
    seqlens: tuple
    H: int
    HV: int
    K: int = 128
    pad: int = 0
    dtype: torch.dtype = torch.bfloat16      # k
    beta_dtype: torch.dtype = torch.float32
    gate: str = "model"

    def __str__(self):
        return self.name


PREP_EDGES = (0, 1, 63, 64, 65, 0, 200, 1, 130, 127, 128, 129)
PREP_CASES = [
    PrepCase("tp1-dense-4k", (4096,), H=16, HV=64),
    PrepCase("edges-gva2-pad37", PREP_EDGES, H=4, HV=8, pad=37, beta_dtype=torch.bfloat16),
    PrepCase("edges-gva2-fp16", PREP_EDGES, H=4, HV=8, pad=37, dtype=torch.float16, beta_dtype=torch.float16),
    PrepCase("gva4-fp16-pad70", (500, 0, 1, 1000, 77), H=4, HV=16, pad=70, dtype=torch.float16,
             beta_dtype=torch.float16),
    PrepCase("gva4-bench-gate", (3000, 1096), H=16, HV=64, gate="bench"),
    PrepCase("gva1-300seqs", random_lengths(300, (0, 1, 2, 5, 63, 64, 65, 100, 150), 1), H=4, HV=4, pad=3),
    PrepCase("gva1-zero-gate", (129, 64), H=4, HV=4, gate="zero"),
    PrepCase("k64-fp16", (100, 64, 3), H=2, HV=4, K=64, pad=9, dtype=torch.float16),
    PrepCase("k256", (100, 64, 3), H=2, HV=4, K=256, pad=9),
    # GVA 3 (27B-style 8/24 and 16/48 layers): beta's padded shared tile, the per-head padding-tail loop
    PrepCase("gva3-edges-pad21", PREP_EDGES, H=2, HV=6, pad=21),
    # 70k sequences: three rounds of the in-kernel chunk search, more chunks than a grid y/z dim holds
    PrepCase("70k-seqs", random_lengths(70000, (0, 1, 2, 3), 2), H=1, HV=1, pad=10),
    # GVA 8: more value heads than warps, inverted in two rounds (or split over two CTAs on a small grid)
    PrepCase("gva8-rounds", (300, 64, 1, 129), H=1, HV=8, pad=5),
    PrepCase("tiny-3", (3,), H=2, HV=2),
]
# test_prepare_fwd_heads_per_cta: every split of a key head's value heads over CTAs
PREP_SPLIT_CASES = [PREP_CASES[1], PREP_CASES[3], PREP_CASES[9], PREP_CASES[11]]
# test_prepare_fwd_offsets_past_2_31_elements (GVA 1: the persistent kernel)
PREP_BIG = PrepCase("2^31", (), H=16, HV=16)
PREP_BWD_CASES = [
    PrepCase("bwd-dense-4k", (4096,), H=16, HV=64),
    PrepCase("bwd-edges-pad37", PREP_EDGES, H=4, HV=8, pad=37),
    PrepCase("bwd-70k-seqs", random_lengths(70000, (0, 1, 2, 3, 70), 3), H=1, HV=2, pad=10),
]

# tests/gpu/test_l2norm.py: (rows shape [B, T, H], K, dtype, input scale): row counts that are and are not multiples
# of the 64-row tile
L2NORM_CASES = [
    ((1, 4096, 16), 128, torch.bfloat16, 1.0),
    ((1, 1001, 3), 128, torch.bfloat16, 30.0),
    ((2, 77, 4), 64, torch.float16, 0.01),
    ((1, 300, 2), 256, torch.bfloat16, 1.0),
    ((1, 1, 1), 128, torch.float16, 5.0),
]
# test_l2norm_offsets_past_2_31_elements: rows [1, T, H] with T * H * K just past 2^31 (its inputs are built there)
L2NORM_BIG = ((1, 2 ** 31 // (16 * 128) + 100, 16), 128, torch.bfloat16)

# tests/gpu/test_group_sum.py: (name, T, H, HV, K, chunk_bwd's dtype, l2norm backward fused, output dtype): the
# model's call, rows that are and are not multiples of the 32-row tile, GVA 1..4, K 64..256, the portable chunk_bwd's
# fp32 input
GROUP_SUM_CASES = [
    ("model-gva2-l2", 4096, 16, 32, 128, torch.bfloat16, True, torch.bfloat16),
    ("ragged-gva2", 1001, 3, 6, 128, torch.bfloat16, False, torch.bfloat16),
    ("gva4-k64-fp16-l2", 77, 4, 16, 64, torch.float16, True, torch.float16),
    ("gva3-k256-l2", 300, 2, 6, 256, torch.bfloat16, True, torch.bfloat16),
    ("gva1-l2", 129, 4, 4, 128, torch.bfloat16, True, torch.bfloat16),
    ("fp32-in-gva2-l2", 200, 2, 4, 128, torch.float32, True, torch.bfloat16),
    ("one-row-fp32-out", 1, 1, 2, 128, torch.bfloat16, False, torch.float32),
]

# tests/gpu/test_e2e_gpu.py through the public API. Few distinct (H, HV, dtype) so the GPU tier compiles few kernel
# variants: most cases share 2/8. Inputs from `_helpers.make_inputs` (beta in the input dtype, fp32 h0).
E2E_CASES = [
    Case("tp1-like-4k", (4096,), H=16, HV=64, K=128, V=128),
    Case("varlen-edges", (0, 1, 63, 64, 65, 1000, 0, 130), H=2, HV=8, K=128, V=128, pad=37),
    Case("gva1-vfirst", (300, 2048), H=4, HV=4, K=128, V=128, state_v_first=True),
    Case("dense-B2-noh0", (777, 777), H=2, HV=8, K=128, V=128, varlen=False, h0=False),
    Case("long-32k", (32768,), H=2, HV=8, K=128, V=128),
    Case("bench-gate-28k+4k", (28672, 4096), H=2, HV=8, K=128, V=128, gate="bench"),
    Case("gva3-varlen", (700, 1, 2000), H=2, HV=6, K=128, V=128, pad=5),
]
# (case, dtype) pairs: every case in bf16, one in fp16
E2E_PAIRS = [(c, torch.bfloat16) for c in E2E_CASES] + [(E2E_CASES[1], torch.float16)]
E2E_L2NORM = Case("l2", (500, 1200), H=2, HV=8, K=128, V=128)
# a scale other than K^-0.5 (the kernels specialise on it), with float64 beta and initial state (they go in as fp32)
E2E_OTHER_SCALE = 0.3
E2E_SCALE_FP64 = Case("scale-fp64", (700, 1, 1500), H=2, HV=8, K=128, V=128, pad=9)
E2E_GRAPH = Case("graph", (3000, 1, 5000), H=2, HV=8, K=128, V=128, pad=11)
# lengths ascending over more CTAs than one wave (the forward's and the backward's grids): the kernels take the
# sequences longest first (`_tl.seq_order`), the reverse of their index order
E2E_ORDER = Case("order", (1, 2, 63, 64, 65, 130, 200, 260, 333, 400, 512, 640, 700, 777, 900, 1000, 1100, 1300),
                 H=2, HV=8, K=128, V=128, pad=5)
# auto dispatch with gradients at head dims the SM90 backward lacks (V = 256): the sm90 forward, prepare_fwd and
# prepare_bwd, and the portable state recompute, chunk_bwd and group_sum
E2E_BWD = Case("bwd", (300, 0, 133), H=2, HV=8, K=128, V=256, pad=5)
# the training forward saving the backward's chunk states against the backward recomputing them: empty and 1-token
# sequences, a partial last chunk, padding, both state layouts
E2E_SAVED_STATES = (Case("saved-states", (1, 0, 700, 64, 1300), H=2, HV=4, K=128, V=128, pad=7),
                    Case("saved-states-vfirst", (129, 2000), H=2, HV=8, K=128, V=128, state_v_first=True))
# g = -inf (a full state reset) at a sequence start and g = -1e30 mid-sequence (docs/numerics.md, the gate floor)
E2E_GATE_FLOOR = Case("gate-floor", (100, 200), H=2, HV=8, K=128, V=128, pad=3)


@dataclasses.dataclass(frozen=True)
class BwdCase:
    """A `chunk_bwd` / `state_recompute` stage case (tests/gpu/test_bwd.py): chunk_bwd gets the float64 reference's
    states rounded to the input dtype (the SM90 state recompute's output dtype, `test_bwd.slot_states`); the float64
    reference and the baseline take them unrounded."""
    name: str
    seqlens: tuple
    H: int
    HV: int
    K: int = 128
    V: int = 128
    pad: int = 0
    dtype: torch.dtype = torch.bfloat16
    beta_dtype: torch.dtype = torch.float32
    h0: bool = True
    dht: bool = True
    state_v_first: bool = False
    gate: str = "model"

    def __str__(self):
        return self.name


# Few distinct builds (the chunk_bwd kernel takes ~15 s to compile on the CPU tier): beta in the input dtype as the
# end-to-end cases pass it, and (H, HV) = 2/8 (the forward's end-to-end cases) unless the case needs other heads.
BWD_CASES = [
    BwdCase("edges-gva4-pad37", FWD_EDGES, H=2, HV=8, pad=37, beta_dtype=torch.bfloat16),
    BwdCase("edges-gva4-fp16-nodht", FWD_EDGES, H=2, HV=8, pad=5, dtype=torch.float16, beta_dtype=torch.float16,
            dht=False),
    BwdCase("gva3", (300, 1, 129), H=2, HV=6, beta_dtype=torch.bfloat16),
    BwdCase("gva4-vfirst", (300, 1, 129), H=2, HV=8, state_v_first=True, beta_dtype=torch.bfloat16),
    BwdCase("bench-gate", (2048, 700), H=2, HV=8, gate="bench", beta_dtype=torch.bfloat16),
    BwdCase("zero-gate", (129, 64), H=2, HV=8, gate="zero", beta_dtype=torch.bfloat16),
    BwdCase("k64-v64", (100, 64, 3), H=2, HV=4, K=64, V=64, pad=9, beta_dtype=torch.bfloat16),
    BwdCase("empty-only-pad10", (0,), H=2, HV=8, pad=10, beta_dtype=torch.bfloat16),
    # two value heads per key head: chunk_bwd adds them into dq and dk itself (TMA reduce-add; red.global.add on the
    # ragged chunks), bf16 and fp16
    BwdCase("gva2-ragged", (300, 1, 129, 64), H=2, HV=4, pad=7, beta_dtype=torch.bfloat16),
    BwdCase("gva2-fp16-nodht", (200, 65), H=2, HV=4, pad=3, dtype=torch.float16, beta_dtype=torch.float16,
            dht=False),
    # GVA 1 with 0- and 1-token sequences and a padding tail; V-first to share the builds of the end-to-end case
    # dense-gva1-vfirst (4/4)
    BwdCase("edges-gva1-vfirst-pad9", (1, 0, 63, 64, 65, 0, 1, 130), H=4, HV=4, pad=9, state_v_first=True,
            beta_dtype=torch.bfloat16),
    # beta in fp32: the call with a beta sigmoid (the activated beta), or with fp32 beta (`flashdelta warmup`'s
    # default beta dtype)
    BwdCase("beta-fp32", (300, 1, 129), H=2, HV=8, pad=5, beta_dtype=torch.float32),
]
# run-to-run bitwise determinism: a group_sum case (GVA 4) and one where chunk_bwd adds the group itself (GVA 2)
BWD_DET_CASES = [BWD_CASES[4], BWD_CASES[8]]
# chunk_dstate (K-first output): the stage cases in the K-first layout
DSTATE_CASES = [c for c in BWD_CASES if not c.state_v_first]
# more than 65,535 sequences, and offsets past 2^31 elements (inputs built in the tests; 2/8 shares the builds above)
# K = V = 64: the per-sequence tensors (h0, dht, dh0: [N, HV, K, V] fp32) and the states take ~40 GB at 70k
# sequences, against ~150 GB at K = V = 128
BWD_MANY_SEQS = BwdCase("bwd-70k-seqs", random_lengths(70000, (0, 1, 2, 3, 65), 5), H=2, HV=8, K=64, V=64,
                        beta_dtype=torch.bfloat16)
BWD_BIG = BwdCase("bwd-2^31", (), H=2, HV=8, beta_dtype=torch.bfloat16)
# the same at two value heads per key head (chunk_bwd's reduce-add into dq and dk [1, T, H, K]): K = V = 64, where
# the states (h) take as many elements per token as v (twice as many at K = V = 128), so that dq's rows pass 2^31
# elements within ~53 GB (do aliases v)
BWD_BIG_GVA2 = BwdCase("bwd-2^31-gva2", (), H=2, HV=4, K=64, V=64, beta_dtype=torch.bfloat16)

# the SM90 backward through the public API (tests/gpu/test_bwd.py), against float64 autograd of the recurrence
BWD_E2E = [
    Case("edges-gva4", FWD_EDGES, H=2, HV=8, K=128, V=128, pad=37),
    Case("dense-gva1-vfirst", (777, 777), H=4, HV=4, K=128, V=128, varlen=False, state_v_first=True),
    Case("gva3", (700, 1, 2000), H=2, HV=6, K=128, V=128, pad=5),
    Case("gva4-noh0-vfirst", (300, 1000), H=2, HV=8, K=128, V=128, h0=False, state_v_first=True),
    Case("zero-gate", (300, 129), H=2, HV=8, K=128, V=128, gate="zero"),
    Case("k64", (500, 3), H=2, HV=4, K=64, V=64),      # two value heads per key head: chunk_bwd sums the group
]
# two value heads per key head at K = V = 128 (the model's 16/32 ratio): chunk_bwd sums the group, and with the
# l2norm group_sum runs at G = 1 for the l2norm backward alone
BWD_E2E_GVA2 = Case("gva2-k128", (300, 1, 1000, 64), H=2, HV=4, K=128, V=128, pad=3)
# (case, dtype, use_qk_l2norm_in_kernel)
BWD_E2E_PAIRS = [(c, torch.bfloat16, False) for c in BWD_E2E] + [
    (BWD_E2E[2], torch.bfloat16, True),
    (BWD_E2E[0], torch.float16, False),
    (BWD_E2E_GVA2, torch.bfloat16, True),
]
# the loss uses o alone (output_final_state=False): chunk_bwd gets no final-state gradient (dht None), the usual
# training call
BWD_E2E_NO_DHT = [
    (BWD_E2E[0], torch.bfloat16, False),
    (BWD_E2E_GVA2, torch.bfloat16, True),
    (BWD_E2E[3], torch.bfloat16, False),
]
# run-to-run bitwise determinism through the public API with the l2norm (its backward in group_sum): GVA 3 and GVA 2
BWD_E2E_DET = [(BWD_E2E[2], torch.bfloat16, True), (BWD_E2E_GVA2, torch.bfloat16, True)]
BWD_GRAPH = Case("bwd-graph", (3000, 1, 5000), H=2, HV=8, K=128, V=128, pad=11)
# dense [B, T] with two lengths under torch.compile(dynamic=True) and torch.utils.checkpoint
BWD_COMPILE = [Case("bwd-compile", (T, T), varlen=False, H=2, HV=8, K=128, V=128) for T in (640, 1000)]
# the two-layer model: H, HV, K, V, T (bf16 with beta in bf16, l2norm in the kernel, no initial state)
BWD_MODEL = Case("bwd-model", (512,), H=2, HV=8, K=128, V=128, h0=False)

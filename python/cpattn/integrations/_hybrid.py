"""Hybrid models under context parallelism: the token mixers outside attention (short
convolutions, Mamba, Mamba-2, the gated delta rule, Kimi delta attention, lightning attention)
made exact on cpattn's shards.

`install()` (called by `register`) replaces the forward of every supported mixer class of
transformers with one that, for a model whose attention implementation is a registered cpattn
name, runs the class's *adapter*: pure torch on the module's own parameters, projections, norms
and gates, with the convolution halo and the state scan of cpattn.mixers over the model's piece
map (from the positions shard_batch gave). Any other model runs the original forward.

Each module is checked once, before its first sharded step, against its own forward on a small
random input in one process (the adapter on emulated pieces of it: out of order, shorter than the
halo and longer than a chunk); a module that differs (a transformers version that changed the
class) is refused on every rank, naming the class and the transformers version.

What is refused, on every rank: the striped layout, invariant mode, a cache (generation with
ContextParallelCache, use_cache=True), a padding mask reaching the mixer, an unknown mixer class
(_model_checks), and a model without attention layers that was not given shard_batch's whole
batch (nothing else would check its positions).
"""

from __future__ import annotations

import copy
import functools
import importlib
import weakref
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.nn.functional as F

from cpattn.core.agreement import agree_on
from cpattn.core.validation import check_timeout
from cpattn.mixers import PieceMap, build_piece_map, stacked
from cpattn.mixers.mixing import Mixing
from cpattn.mixers.sharded import check_settings, exchange_of, piece_map_of
from cpattn.parallel import ContextParallel
from cpattn.sharding.packing import KEYWORD, Documents

WHAT = "cpattn.integrations.transformers"


def _act(name):
    from transformers.activations import ACT2FN

    return ACT2FN[name]


def _tokens(h: torch.Tensor, fn: Callable):
    """fn(h) for a per-token function of the module's own (its reshapes cannot infer a head
    count from no tokens: a rank holding none runs it on one zero token, then keeps none)."""
    if h.shape[1]:
        return fn(h)
    out = fn(torch.cat([h, h.new_zeros((h.shape[0], 1, *h.shape[2:]))], 1))
    return tuple(t[:, :0] for t in out) if isinstance(out, tuple) else out[:, :0]


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


# --- adapters ------------------------------------------------------------------------------------

def short_conv(m, h: torch.Tensor, mix: Mixing) -> torch.Tensor:
    """LFM2: y = C * conv(B * x), then out_proj (Lfm2ShortConv, Lfm2MoeShortConv)."""
    b, c, x = m.in_proj(h).chunk(3, dim=-1)
    return m.out_proj(c * mix.conv(b * x, m.conv))


def mamba2(m, h: torch.Tensor, mix: Mixing) -> torch.Tensor:
    """Mamba-2 (SSD: a scalar decay per head): Mamba2Mixer, BambaMixer,
    GraniteMoeHybridMambaLayer, NemotronHMamba2Mixer, Zamba2MambaMixer, and FalconH1Mixer with
    its multipliers and optional norm."""
    falcon = hasattr(m, "mup_vector")
    dtype = h.dtype
    if falcon:
        h = h * m.ssm_in_multiplier
    projected = m.in_proj(h)
    if falcon:
        projected = projected * m.mup_vector
    gate, xbc, dt = projected.split([m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)
    xbc = m.act(mix.conv(xbc, m.conv1d))
    groups_state = (xbc.shape[-1] - m.intermediate_size) // 2
    x, b, c = xbc.split([m.intermediate_size, groups_state, groups_state], dim=-1)
    heads, groups = m.num_heads, m.n_groups
    dt = F.softplus(dt + m.dt_bias.to(dt.dtype)).clamp(*m.time_step_limit).float()
    a = -torch.exp(m.A_log.float())
    x = x.unflatten(-1, (heads, -1)).float()  # (unflatten: also for a rank without tokens)
    b, c = (t.unflatten(-1, (groups, -1)).float()
            .repeat_interleave(heads // groups, dim=2) for t in (b, c))
    y = mix.scalar_decay(c, b, x * dt[..., None], a * dt) + m.D.float()[:, None] * x
    y = y.flatten(-2)
    if falcon and not m.mamba_rms_norm:
        y = y * F.silu(gate)
    else:
        y = m.norm(y, gate)
    return m.out_proj(y.to(dtype))


def _delta_rule(m, h, mix: Mixing, mixed, z, b, a, beta_scale: float = 1.0):
    """The gated delta rule on the projections (Qwen3-Next, Qwen3.5, OLMo-Hybrid): conv + SiLU,
    l2-normalised q and k, decay g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)."""
    batch, length = h.shape[:2]
    mixed = _act(m.activation)(mix.conv(mixed, m.conv1d))
    q, k, v = mixed.split([m.key_dim, m.key_dim, m.value_dim], dim=-1)
    q, k = (t.unflatten(-1, (-1, m.head_k_dim)) for t in (q, k))
    v = v.unflatten(-1, (-1, m.head_v_dim))
    beta = b.sigmoid() * beta_scale
    g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)
    repeat = m.num_v_heads // m.num_k_heads
    q, k = (t.repeat_interleave(repeat, dim=2).float() for t in (q, k))
    q = _l2norm(q) * q.shape[-1] ** -0.5
    k = _l2norm(k)
    return mix.delta_rule(q, k, v.float(), g, beta.float()).to(h.dtype), z


def gated_delta_split(m, h: torch.Tensor, mix: Mixing) -> torch.Tensor:
    """Qwen3_5GatedDeltaNet, Qwen3_5MoeGatedDeltaNet: separate qkv / z / b / a projections."""
    batch, length = h.shape[:2]
    z = m.in_proj_z(h).unflatten(-1, (-1, m.head_v_dim))
    y, z = _delta_rule(m, h, mix, m.in_proj_qkv(h), z, m.in_proj_b(h), m.in_proj_a(h))
    y = m.norm(y.reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim))
    return m.out_proj(y.reshape(batch, length, m.value_dim))


def gated_delta_fused(m, h: torch.Tensor, mix: Mixing) -> torch.Tensor:
    """Qwen3NextGatedDeltaNet: the fused in_proj_qkvz / in_proj_ba, split by the module's own
    fix_query_key_value_ordering."""
    batch, length = h.shape[:2]
    q, k, v, z, b, a = _tokens(h, lambda t: m.fix_query_key_value_ordering(m.in_proj_qkvz(t),
                                                                           m.in_proj_ba(t)))
    mixed = torch.cat([t.flatten(-2) for t in (q, k, v)], dim=-1)
    y, z = _delta_rule(m, h, mix, mixed, z, b, a)
    y = m.norm(y.reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim))
    return m.out_proj(y.reshape(batch, length, m.value_dim))


def gated_delta_olmo(m, h: torch.Tensor, mix: Mixing) -> torch.Tensor:
    """OlmoHybridGatedDeltaNet: q / k / v / a / b / g projections, beta x2 with negative
    eigenvalues allowed."""
    batch, length = h.shape[:2]
    mixed = torch.cat([m.q_proj(h), m.k_proj(h), m.v_proj(h)], dim=-1)
    y, _ = _delta_rule(m, h, mix, mixed, None, m.b_proj(h), m.a_proj(h),
                       2.0 if m.allow_neg_eigval else 1.0)
    gate = m.g_proj(h)
    y = m.o_norm(y.reshape(-1, m.head_v_dim), gate.reshape(-1, m.head_v_dim))
    return m.o_proj(y.reshape(batch, length, m.value_dim))


def kimi_delta(m, h: torch.Tensor, mix: Mixing) -> torch.Tensor:
    """KimiLinearDeltaAttention: the delta rule with a decay per key channel (the module's own
    forget_gate), gated RMSNorm output."""
    mixed = torch.cat([m.q_proj(h), m.k_proj(h), m.v_proj(h)], dim=-1)
    mixed = _act(m.activation)(mix.conv(mixed, m.conv1d))
    q, k, v = (t.unflatten(-1, (-1, m.head_dim)).float()
               for t in mixed.split([m.qkv_dim] * 3, dim=-1))
    g = _tokens(h, m.forget_gate).float()
    beta = torch.sigmoid(m.b_proj(h)).float()
    q = _l2norm(q) * q.shape[-1] ** -0.5
    k = _l2norm(k)
    y = mix.kda(q, k, v, g, beta).to(h.dtype)
    gate = m.g_b_proj(m.g_a_proj(h)).unflatten(-1, (-1, m.head_dim))
    return m.o_proj(m.o_norm(y, gate).flatten(-2))


def lightning(m, h: torch.Tensor, mix: Mixing):
    """MiniMaxLightningAttention: linear attention with a constant decay per head
    exp(-slope_rate); returns (out, None) like the module (its second output, the final state,
    is not used in training)."""
    batch, length = h.shape[:2]
    heads, d = m.num_attention_heads, m.head_dim
    qkv = m.act_fn(m.qkv_proj(h)).reshape(batch, length, heads, 3 * d)
    q, k, v = (t.float() for t in qkv.split(d, dim=-1))
    decay = (-m.slope_rate.reshape(heads).float()).expand(batch, length, heads)
    y = mix.scalar_decay(q, k, v, decay)
    y = m.norm(y.reshape(batch, length, heads * d).to(h.dtype))
    y = torch.sigmoid(m.output_gate(h)) * y
    return m.out_proj(y), None


def mamba1(m, h: torch.Tensor, mix: Mixing) -> torch.Tensor:
    """Mamba (a decay per channel and state entry): MambaMixer, and FalconMambaMixer and
    JambaMambaMixer with their RMSNorms on dt, B and C."""
    dtype = h.dtype
    x, gate = m.in_proj(h).chunk(2, dim=-1)
    x = m.act(mix.conv(x, m.conv1d))
    step, b, c = m.x_proj(x).split([m.time_step_rank, m.ssm_state_size, m.ssm_state_size],
                                   dim=-1)
    if hasattr(m, "b_layernorm"):
        step, b, c = m.dt_layernorm(step), m.b_layernorm(b), m.c_layernorm(c)
    # dt, the state's readout and the gate in the dtypes the module has them (bf16 under
    # autocast), the scan in fp32
    dt = step @ m.dt_proj.weight.t()
    if m.dt_proj.bias is not None:
        dt = dt + m.dt_proj.bias.to(dt.dtype)
    dt = F.softplus(dt)
    a = -torch.exp(m.A_log.float())  # (I, N)
    y = mix.selective_scan(dt, a, x, b, c).to(x.dtype) + x * m.D.float()
    y = y * F.silu(gate)
    return m.out_proj(y.to(dtype))


# class name -> (model types whose mixer it is, adapter)
ADAPTERS: dict[str, Callable] = {
    "Lfm2ShortConv": short_conv, "Lfm2MoeShortConv": short_conv,
    "Mamba2Mixer": mamba2, "BambaMixer": mamba2, "GraniteMoeHybridMambaLayer": mamba2,
    "NemotronHMamba2Mixer": mamba2, "FalconH1Mixer": mamba2, "Zamba2MambaMixer": mamba2,
    "Qwen3NextGatedDeltaNet": gated_delta_fused, "Qwen3_5GatedDeltaNet": gated_delta_split,
    "Qwen3_5MoeGatedDeltaNet": gated_delta_split, "OlmoHybridGatedDeltaNet": gated_delta_olmo,
    "MambaMixer": mamba1, "FalconMambaMixer": mamba1, "JambaMambaMixer": mamba1,
    "KimiLinearDeltaAttention": kimi_delta, "MiniMaxLightningAttention": lightning,
}
# model type -> its modeling module and mixer classes (all of them have adapters).
FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "lfm2": ("lfm2", ("Lfm2ShortConv",)), "lfm2_moe": ("lfm2_moe", ("Lfm2MoeShortConv",)),
    "mamba2": ("mamba2", ("Mamba2Mixer",)), "bamba": ("bamba", ("BambaMixer",)),
    "granitemoehybrid": ("granitemoehybrid", ("GraniteMoeHybridMambaLayer",)),
    "nemotron_h": ("nemotron_h", ("NemotronHMamba2Mixer",)),
    "falcon_h1": ("falcon_h1", ("FalconH1Mixer",)),
    "zamba2": ("zamba2", ("Zamba2MambaMixer",)),
    "qwen3_next": ("qwen3_next", ("Qwen3NextGatedDeltaNet",)),
    "qwen3_5_text": ("qwen3_5", ("Qwen3_5GatedDeltaNet",)),
    "qwen3_5": ("qwen3_5", ("Qwen3_5GatedDeltaNet",)),
    "qwen3_5_moe_text": ("qwen3_5_moe", ("Qwen3_5MoeGatedDeltaNet",)),
    "qwen3_5_moe": ("qwen3_5_moe", ("Qwen3_5MoeGatedDeltaNet",)),
    "olmo_hybrid": ("olmo_hybrid", ("OlmoHybridGatedDeltaNet",)),
    "mamba": ("mamba", ("MambaMixer",)), "falcon_mamba": ("falcon_mamba", ("FalconMambaMixer",)),
    "jamba": ("jamba", ("JambaMambaMixer",)),
    "kimi_linear": ("kimi_linear", ("KimiLinearDeltaAttention",)),
    "minimax": ("minimax", ("MiniMaxLightningAttention",)),
}
# Models that do not hand their keywords down to the mixers: shard_batch's documents reach them
# through these models' forwards (recorded for their duration).
_BASE_MODELS = {"mamba": ("MambaModel", "MambaForCausalLM"),
                "falcon_mamba": ("FalconMambaModel", "FalconMambaForCausalLM"),
                "mamba2": ("Mamba2Model", "Mamba2ForCausalLM"),
                "jamba": ("JambaModel", "JambaForCausalLM")}
_ATTENTION_FREE = frozenset({"mamba", "falcon_mamba", "mamba2"})


def handles(model_type: str) -> bool:
    """Whether every token mixer of the model type runs exactly under context parallelism (its
    classes are installed)."""
    family = FAMILIES.get(model_type)
    return family is not None and all(c in ORIGINALS for c in family[1])


def mixer_classes(model_type: str) -> tuple[str, ...]:
    family = FAMILIES.get(model_type)
    return family[1] if family is not None else ()


# --- installing ----------------------------------------------------------------------------------

ORIGINALS: dict[str, tuple[type, Callable, Callable]] = {}  # class name -> (class, forward, init)
_LOOKUP: list = []  # [settings_of(name) -> ContextParallel or None], set by install
_MODULES: dict[int, weakref.ref] = {}  # id -> the mixer modules built since install
_DOCUMENTS: list = []  # shard_batch's documents of the base model forwards in progress


def install(settings_of: Optional[Callable[[str], Optional[ContextParallel]]] = None) -> None:
    """Patches the supported mixer classes (idempotent). settings_of(attn_implementation) gives
    the registered settings of a cpattn name, None for any other implementation (register's;
    None keeps the one installed, if any: without one every mixer runs its original forward)."""
    first = not ORIGINALS
    if settings_of is not None:
        _LOOKUP[:] = [settings_of]
    for model_type, (module_name, classes) in FAMILIES.items():
        try:
            module = importlib.import_module(f"transformers.models.{module_name}."
                                             f"modeling_{module_name}")
        except ImportError:  # (a transformers without this family: it stays refused)
            continue
        for name in classes:
            cls = getattr(module, name, None)
            if cls is not None and name not in ORIGINALS:
                ORIGINALS[name] = (cls, cls.forward, cls.__init__)
                cls.__init__ = _recording_init(cls.__init__)
                cls.forward = _mixer_forward(name, cls.forward)
        for base in _BASE_MODELS.get(model_type, ()):
            cls = getattr(module, base, None)
            if cls is not None and base not in ORIGINALS:
                ORIGINALS[base] = (cls, cls.forward, cls.__init__)
                cls.forward = _documents_forward(cls.forward)
    if first:
        _adopt_existing()


def _adopt_existing() -> None:
    """Records the config of the mixers of models built before the first install (their
    __init__ did not): each gets its innermost model's, so that a model switched to a cpattn
    attention implementation afterwards (set_attn_implementation) is not run unsharded."""
    import gc

    from transformers import PreTrainedModel

    # (type(), not isinstance: that would read __class__ of every object, proxies included)
    models = [o for o in gc.get_objects() if issubclass(type(o), PreTrainedModel)]
    for model in sorted(models, key=lambda m: sum(1 for _ in m.modules())):
        for module in model.modules():
            if type(module).__name__ in ADAPTERS and not hasattr(module, "_cpattn_config"):
                _record(module, model.config)


def _recording_init(init: Callable) -> Callable:
    @functools.wraps(init)
    def __init__(self, config, *args, **kwargs):
        init(self, config, *args, **kwargs)
        _record(self, config)
    return __init__


def _record(module, config) -> None:
    module._cpattn_config = config  # (most mixers keep no reference to their config)
    key = id(module)
    _MODULES[key] = weakref.ref(module, lambda _: _MODULES.pop(key, None))


def _documents_forward(forward: Callable) -> Callable:
    @functools.wraps(forward)
    def wrapped(self, *args, **kwargs):
        _DOCUMENTS.append(kwargs.get(KEYWORD, _ABSENT))
        try:
            return forward(self, *args, **kwargs)
        finally:
            _DOCUMENTS.pop()
    return wrapped


_ABSENT = object()


def _config(module):
    config = getattr(module, "config", None)
    return config if config is not None else getattr(module, "_cpattn_config", None)


def _settings(module) -> Optional[ContextParallel]:
    config = _config(module)
    name = getattr(config, "_attn_implementation", None)
    return _LOOKUP[0](name) if _LOOKUP and name is not None else None


def _mixer_forward(name: str, forward: Callable) -> Callable:
    @functools.wraps(forward)
    def wrapped(self, hidden_states=None, *args, **kwargs):
        cp = _settings(self)
        if cp is None:
            return forward(self, hidden_states, *args, **kwargs)
        return _sharded_forward(cp, name, self, hidden_states, args, kwargs)
    return wrapped


# --- the sharded forward ----------------------------------------------------------------------

def _sharded_forward(cp: ContextParallel, name: str, module, hidden_states, args, kwargs):
    if hidden_states is None:
        hidden_states = kwargs.pop("hidden_states", None)
    cache = next((kwargs.get(k) for k in ("cache", "cache_params", "past_key_values")
                  if kwargs.get(k) is not None), None)
    mask = kwargs.get("attention_mask")
    if mask is None and args and name == "MiniMaxLightningAttention" and len(args) > 1:
        mask = args[1]  # (position_embeddings, attention_mask) positionally
    documents = kwargs.get(KEYWORD, _ABSENT)
    if documents is _ABSENT:  # (the innermost model forward in progress that was given them)
        documents = next((d for d in reversed(_DOCUMENTS) if d is not _ABSENT), _ABSENT)
    model_type = getattr(_config(module), "model_type", "")
    local = hidden_states.shape[1]

    def check():
        check_settings(cp, WHAT)
        if cache is not None:
            raise ValueError(_cache_refusal(name, cache))
        if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2
                                     and bool(mask.all())):
            raise ValueError(f"{WHAT}: {name} got an attention mask (padding): under context "
                             "parallelism give the padded batch to cpattn.shard_batch (it unpads "
                             "the rows into documents) and pass no attention_mask to the model")
        if documents is _ABSENT and model_type in _ATTENTION_FREE:
            raise ValueError(f"{WHAT}: the {model_type!r} model has no attention layer to check "
                             "the tokens' positions, so cpattn needs shard_batch's documents: "
                             f"pass the whole batch of cpattn.shard_batch to the model "
                             f"(model(**batch) without 'shift_labels': its {KEYWORD!r})")
        docs = None if documents is _ABSENT else documents
        if docs is not None and not isinstance(docs, Documents):
            raise ValueError(f"{WHAT}: {KEYWORD} must be the cpattn.sharding.packing.Documents "
                             "that cpattn.shard_batch made")
        if docs is not None and hidden_states.shape[0] != 1:
            raise ValueError(f"{WHAT}: packed documents are one row, got a batch of "
                             f"{hidden_states.shape[0]}")
        piece_map = piece_map_of(cp, local, docs)
        if piece_map.local_len[cp.rank] != local:
            raise ValueError(f"{WHAT}: {name} got {local} tokens; this rank holds "
                             f"{piece_map.local_len[cp.rank]} of the batch "
                             "(pass shard_batch's tokens)")
        verdict = _verdict(name, id(module))
        if verdict:
            raise ValueError(verdict)
        # (not the local length: under a document plan the ranks hold different numbers)
        return piece_map, [("mixer", name), ("piece map", piece_map.signature),
                      ("hidden_states.batch", hidden_states.shape[0]),
                      ("hidden_states.hidden", hidden_states.shape[-1]),
                      ("hidden_states.dtype", hidden_states.dtype),
                      ("hidden_states.device", hidden_states.device.type)]

    piece_map = _agree(cp, check)
    mix = Mixing(piece_map, cp.rank, exchange_of(cp), hidden_states.shape[0])
    return ADAPTERS[name](module, hidden_states, mix)


def _agree(cp: ContextParallel, check: Callable[[], tuple[Any, list]]) -> PieceMap:
    """check() (the arguments and their fields) agreed over cp's ranks: for hybrid over its
    Ulysses groups, then its ring groups (an error in one Ulysses group raises in all)."""
    timeout = check_timeout(WHAT, cp.timeout, cp.groups[-1])  # (hybrid: the ring's)
    if len(cp.groups) == 1:
        return agree_on(WHAT, cp.group, timeout, check)
    failure: list = []
    try:
        result = agree_on(WHAT, cp.ulysses_group, timeout, check)
    except ValueError as e:
        result, failure[:] = None, [e]

    def across():
        if failure:
            raise failure[0]
        return result, []

    try:
        return agree_on(WHAT, cp.ring_group, timeout, across)
    finally:
        failure.clear()


def _cache_refusal(name: str, cache) -> str:
    if type(cache).__name__ == "ContextParallelCache":
        return (f"{WHAT}: generate with ContextParallelCache does not support models with "
                f"token-mixing layers outside attention yet ({name}: its convolution and "
                "recurrent states are not kept in the sharded cache); generate without context "
                "parallelism for this model")
    return (f"{WHAT}: {name} got a cache (use_cache=True, transformers' default): pass "
            "use_cache=False to the model (or set config.use_cache = False) for training")


# --- the equivalence probe -----------------------------------------------------------------------

_VERDICTS = weakref.WeakKeyDictionary()  # module -> "" (matches its own forward) or the refusal
PROBE_TOKENS = (70, 2, 61)  # the probe's pieces: out of order, one shorter than any halo


@torch._dynamo.assume_constant_result
def _verdict(name: str, key: int) -> str:
    """probe() of the mixer module with id `key` (a constant under torch.compile: run in Python
    while dynamo traces)."""
    ref = _MODULES.get(key)
    module = ref() if ref is not None else None
    if module is None:  # (not seen being built, nor found when the classes were installed)
        return (f"{WHAT}: {name} was built before cpattn's register(): register first, then "
                "build the model")
    return probe(name, module)


def probe(name: str, module) -> str:
    """"" when the adapter of `name` on emulated pieces of a random input matches the module's
    own forward (fp32, one process), else the refusal naming the class and the transformers
    version. Once per module."""
    verdict = _VERDICTS.get(module)
    if verdict is None:
        verdict = _probe(name, module)
        _VERDICTS[module] = verdict
    return verdict


def _probe(name: str, module) -> str:
    import transformers

    reference_module = copy.deepcopy(module).float().train(False)
    original = ORIGINALS[name][1]
    lengths = PROBE_TOKENS
    total = sum(lengths)
    gen = torch.Generator().manual_seed(1234)
    device = next(reference_module.parameters()).device
    hidden = getattr(reference_module, "hidden_size", None) or _in_features(reference_module)
    x = torch.randn(2, total, hidden, generator=gen).to(device)
    # One rank holds the pieces out of order: [2, 72), [0, 2), [72, total).
    a, b, _ = lengths
    order = torch.cat([torch.arange(b, b + a), torch.arange(0, b), torch.arange(a + b, total)])
    piece_map = build_piece_map([order], (0, total))
    mix = Mixing(piece_map, 0, stacked, 2)
    try:
        # (fp32 and no autocast: the check compares the math, not one dtype's rounding)
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            kwargs = {"position_embeddings": None, "attention_mask": None} \
                if name == "MiniMaxLightningAttention" else {}
            expected = original(reference_module, x, **kwargs)
            got = ADAPTERS[name](reference_module, x[:, order.to(device)], mix)
            if isinstance(expected, tuple):
                expected, got = expected[0], got[0]
            got = torch.empty_like(got).index_copy_(1, order.to(device), got)
        scale = float(expected.abs().max())
        error = float((got - expected).abs().max())
        if error <= 1e-4 * max(scale, 1e-6):
            return ""
        detail = f"differs by {error:.3g} (largest output {scale:.3g})"
    except Exception as e:  # noqa: BLE001 - any failure of the adapter refuses the model
        detail = f"fails ({type(e).__name__}: {e})"
    return (f"{WHAT}: cpattn's exact version of {name} {detail} from the module's own forward "
            f"under transformers {transformers.__version__}: this transformers changed the "
            "class, so cpattn refuses the model under context parallelism (it would not train "
            "the same model)")


def _in_features(module) -> int:
    for child in module.modules():
        if isinstance(child, torch.nn.Linear):
            return child.in_features
    raise ValueError("no input projection")

"""``kvslim.distributed.apply``: sequence-parallel decode of a kvslim method on every rank of a torchrun job.

Every rank loads the same model (weights replicated), calls :func:`apply` with the same arguments and then the
same ``model.generate(...)``; each rank stores only its slice of every layer's cache and all ranks produce the
same tokens. Start-up refuses ranks that disagree on the method, its options, the placement, the config or the
weights (by name); every ``generate`` call checks that the ranks got the same prompt and arguments.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import torch
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from .. import api
from ..adapters.compat import CACHE_KW, CACHE_KWS
from ..plan import Plan
from . import mla as mla_hook
from . import slim as slim_hook
from .attention import _RUNTIME, NAME, seqpar_attention_forward
from .cache import ShardedCache, make_sharded_cache
from .group import DEFAULT_TIMEOUT_S, Comm, check_agreement, fingerprint_tensor, init_group, model_fingerprint
from .merge import MERGES
from .placement import RULES, check_split

_STATE = "_kvslim_seqpar_state"


@dataclass(frozen=True)
class SeqParallelOptions:
    """How the ranks share the sequence (every field must be the same on every rank).

    Attributes:
        rule: where decoded tokens go: ``"fewest"`` (the rank holding the fewest tokens, ties to the lower rank)
            or ``"round_robin"`` (the k-th decoded token to rank k mod N).
        split: prompt slice weights, one per rank (``None``: equal slices); zeros give empty slices.
        merge: ``"auto"``, ``"gather"`` (one all-gather per layer) or ``"reduce"`` (two all-reduces).
        timeout_s: bound on every collective; a dead or stuck rank surfaces as :class:`DistributedError` on the
            others within it.
        backend: ``"gloo"``, ``"nccl"`` or ``None`` (NCCL when CUDA is available, else gloo).
        watchdog: end the process if one collective stays pending past 2·timeout_s + 10 s.
        project: slim K-/X-caches and MLA: apply the value map (``W_KV`` / ``W_UV``) ``"after"`` the merge (on the
            merged c-wide / dc-wide row, as the issue describes) or ``"before"`` it, on each rank's own partial —
            the same maths (the map is linear and the merge a weighted sum) with a head_dim-wide collective:
            h× fewer bytes for slim (d/dk), dc/dv× for MLA.
    """

    rule: str = "fewest"
    split: tuple | None = None
    merge: str = "auto"
    timeout_s: float = DEFAULT_TIMEOUT_S
    backend: str | None = None
    watchdog: bool = True
    project: str = "after"

    def __post_init__(self) -> None:
        if self.project not in ("after", "before"):
            raise ValueError(f"project must be 'after' or 'before', got {self.project!r}")
        if self.rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {self.rule!r}")
        if self.merge not in MERGES:
            raise ValueError(f"merge must be one of {MERGES}, got {self.merge!r}")
        if not isinstance(self.timeout_s, (int, float)) or isinstance(self.timeout_s, bool) or self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be a positive number of seconds, got {self.timeout_s!r}")
        if self.split is not None:
            object.__setattr__(self, "split", tuple(self.split))
        if not isinstance(self.watchdog, bool):
            raise ValueError(f"watchdog must be True or False, got {self.watchdog!r}")


class SeqParallel:
    """The sequence-parallel state of one model on one rank (returned by :func:`apply`).

    Attributes:
        plan: the kvslim plan (the whole model's cache; each rank holds about 1/N of it).
        comm: this rank's counted collectives (``comm.sent_bytes``: bytes sent so far).
        cache: the :class:`ShardedCache` of the last ``generate`` call (or :meth:`make_cache`).
    """

    def __init__(self, model, plan: Plan, comm: Comm, opts: SeqParallelOptions, prompt_impl: str):
        self.model, self.plan, self.comm, self.opts = model, plan, comm, opts
        self.rank, self.world_size = comm.rank, comm.world_size
        self.merge = opts.merge
        self.project = opts.project
        self.prompt_impl = prompt_impl
        self.cache: ShardedCache | None = None

    def make_cache(self, max_length: int | None = None) -> ShardedCache:
        """A fresh sharded cache for this rank (also the one the attention hooks read)."""
        self.cache = make_sharded_cache(self.plan, self.rank, self.world_size, rule=self.opts.rule,
                                        split=self.opts.split, max_length=max_length, runtime=self)
        return self.cache

    def cache_bytes_per_rank(self) -> list[int]:
        """Every rank's live cache bytes (a collective: call it on every rank)."""
        mine = 0 if self.cache is None else self.cache.nbytes
        return [int(x) for x in self.comm.all_gather_object(mine, "cache size exchange")]


def apply(model: torch.nn.Module, method: str, *, rule: str = "fewest", split=None, merge: str = "auto",
          timeout_s: float = DEFAULT_TIMEOUT_S, backend: str | None = None, watchdog: bool = True,
          project: str = "after", **options) -> SeqParallel:
    """Prepare ``model`` for sequence-parallel decode with kvslim ``method`` on this rank.

    Call on every rank with the same arguments (inside ``torchrun``; a plain process is a one-rank job). After it,
    ``model.generate(...)`` shards the cache across the ranks. ``options`` go to :func:`kvslim.apply`.

    Raises:
        ValueError: bad options (nothing changed).
        DistributedError: the ranks disagree on the method, options, placement, config or weights (named).
    """
    opts = SeqParallelOptions(rule, split, merge, timeout_s, backend, watchdog, project)
    restore(model)
    rank, world = init_group(opts.backend, opts.timeout_s)
    check_split(opts.split, world)
    comm = Comm(rank, world, opts.timeout_s, opts.watchdog)
    items = {"method": method, "options": repr(sorted(options.items())), "rule": opts.rule,
             "split": repr(opts.split), "merge": opts.merge, "project": opts.project, "timeout_s": repr(opts.timeout_s),
             "torch": torch.__version__, "kvslim": _kvslim_version()} | model_fingerprint(model)
    check_agreement(comm, items)
    plan = api.apply(model, method, **options)
    try:
        check_agreement(comm, {"plan": hashlib.sha256(repr(plan.to_dict()).encode()).hexdigest()[:16]}, "plan")
        make_sharded_cache(plan, rank, world)  # every layer has a sharded twin (ValueError otherwise)
    except Exception:
        api.restore(model)
        raise
    previous = model.config._attn_implementation
    rt = SeqParallel(model, plan, comm, opts, previous)
    AttentionInterface.register(NAME, seqpar_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    for m in model.modules():
        if hasattr(m, "layer_idx"):
            setattr(m, _RUNTIME, rt)
    if plan.method == "slim":
        from ..adapters.slim_patch import RopeTable
        from ..methods.slim import ADAPTERS

        adapter = ADAPTERS[model.config.model_type]
        rotary = adapter.rotary(model)
        slim_hook.patch(model, rt, adapter, getattr(plan, "_slim_weights", {}),
                        RopeTable(rotary) if rotary is not None else None)
    elif plan.method == "mla":
        mla_hook.patch(model, rt)
    original = type(model).generate.__get__(model)

    @functools.wraps(original)
    def generate(*args, **kwargs):
        if all(kwargs.get(name) is None for name in CACHE_KWS):
            ids = kwargs.get("input_ids", args[0] if args else None)
            call = {"generate arguments": repr(sorted((k, v) for k, v in kwargs.items()
                                                      if isinstance(v, (int, float, str, bool, type(None))))),
                    "input_ids": fingerprint_tensor(ids) if isinstance(ids, torch.Tensor) else repr(ids)}
            mask = kwargs.get("attention_mask")
            if isinstance(mask, torch.Tensor):
                call["attention_mask"] = fingerprint_tensor(mask)
            check_agreement(comm, call, "generate")
            kwargs[CACHE_KW] = rt.make_cache(_max_length(ids, kwargs, model))
        return original(*args, **kwargs)

    model.generate = generate
    setattr(model, _STATE, (rt, previous))
    return rt


def restore(model: torch.nn.Module) -> None:
    """Undo :func:`apply` (and the kvslim method under it); no-op if it was never applied."""
    state = vars(model).pop(_STATE, None)
    if state is None:
        return
    rt, previous = state
    slim_hook_adapter = None
    if rt.plan.method == "slim":
        from ..methods.slim import ADAPTERS

        slim_hook_adapter = ADAPTERS[model.config.model_type]
        slim_hook.unpatch(model, slim_hook_adapter)
    elif rt.plan.method == "mla":
        mla_hook.unpatch(model)
    for m in model.modules():
        if hasattr(m, _RUNTIME):
            delattr(m, _RUNTIME)
    if model.config._attn_implementation == NAME:
        model.set_attn_implementation(previous)
    if "generate" in vars(model):
        del model.generate
    api.restore(model)


def _max_length(ids, kwargs, model) -> int | None:
    new = kwargs.get("max_new_tokens")
    if new is None:
        gc = kwargs.get("generation_config") or getattr(model, "generation_config", None)
        new = getattr(gc, "max_new_tokens", None)
    if not isinstance(ids, torch.Tensor) or new is None:
        return None
    return int(ids.shape[-1]) + int(new)


def _kvslim_version() -> str:
    from .. import __version__

    return __version__

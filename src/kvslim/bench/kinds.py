"""The cache kinds ``kvslim bench`` compares (no torch import: ``kvslim bench --help`` lists them instantly)."""

from __future__ import annotations

#: cache kinds: HF baselines and kvslim methods (name -> kvslim.apply arguments; each method's defaults, i.e.
#: what ``apply(model, "int4")`` gives a user)
#: ``kvslim-slim`` is slim attention option 2 (K-only cache, V rebuilt after the softmax-weighted sum; MHA only).
KVSLIM_KINDS = {"kvslim-dense": ("dense", {}), "kvslim-int8": ("int8", {}), "kvslim-int4": ("int4", {}),
                "kvslim-int3": ("int3", {}), "kvslim-int2": ("int2", {}), "kvslim-slim": ("slim", {"cache": "k", "rank": 0}),
                "kvslim-turbo3": ("turbo3", {}), "kvslim-turbo2": ("turbo2", {}),
                "kvslim-turbo3-prerope": ("turbo3", {"prerope_keys": True}),
                "kvslim-turbo3-rc": ("turbo3", {"rope_centred_keys": True}),
                "kvslim-turbo2-rc": ("turbo2", {"rope_centred_keys": True}),
                # sparse decode (issue 43, docs/sparse.md): the method's defaults + a 2,048-token budget per step
                "kvslim-dense-sparse": ("dense", {"sparse_budget": 2048}),
                "kvslim-int4-sparse": ("int4", {"sparse_budget": 2048}),
                # the recommended budget: max(2,048, an eighth of the context), the full read below the crossover
                "kvslim-int4-sparse-auto": ("int4", {"sparse_budget": "auto"})}
HF_KINDS = ("hf-dynamic", "hf-static")
ALL_KINDS = HF_KINDS + tuple(KVSLIM_KINDS)

"""The method protocol: one technique = one module + one options dataclass + one registry entry."""

from __future__ import annotations

import torch

from ..adapters.shape import ModelShape, shape_from_config
from ..plan import Plan

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def parse_dtype(dtype: str | torch.dtype, name: str = "dtype") -> torch.dtype:
    """``torch.dtype`` from a dtype or its name; ``ValueError`` naming ``name`` otherwise."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"{name} must be one of float32, float16, bfloat16, got {dtype!r}")


class NotApplicable(ValueError):
    """A method refuses a model's shape (``shape``): :func:`kvslim.apply` adds the methods that do apply (the
    registry imports this module, so the list is made there)."""

    def __init__(self, message: str, shape: ModelShape):
        super().__init__(message)
        self.shape = shape


def model_dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype


class Method:
    """Base class of a kvslim technique.

    ``plan`` works from the config alone (``kvslim plan``); ``plan_model`` may read weights (slim attention
    measures them) but changes nothing; ``prepare`` changes the model in place (patching attention) and
    ``restore`` undoes it. Every refusal is a ``ValueError`` raised before anything changes.
    """

    name: str = ""
    #: model_types whose HF attention this method has been tested with
    model_types: tuple[str, ...] = ()

    def not_applicable(self, shape: ModelShape) -> str | None:
        """Why this method does not apply to ``shape``, or ``None`` if it does."""
        return None

    def supports(self, shape: ModelShape) -> bool:
        """Whether this method applies to models of ``shape`` (its model_type and attention family)."""
        return (not self.model_types or shape.model_type in self.model_types) and self.not_applicable(shape) is None

    def plan(self, shape: ModelShape, dtype: torch.dtype, **options) -> Plan:
        raise NotImplementedError

    def check_model(self, model) -> ModelShape:
        """The model's shape; :class:`NotApplicable` (a ``ValueError``) saying why this method cannot serve it."""
        shape = shape_from_config(model.config)
        reason = self.not_applicable(shape)
        if reason:
            raise NotApplicable(f"method {self.name!r} does not apply to model_type {shape.model_type!r}: {reason}",
                                shape)
        if self.model_types and shape.model_type not in self.model_types:
            raise NotApplicable(f"method {self.name!r} does not support model_type {shape.model_type!r}; "
                                f"supported: {', '.join(self.model_types)}", shape)
        return shape

    def plan_model(self, model, **options) -> Plan:
        shape = self.check_model(model)
        return self.plan(shape, model_dtype(model), **options)

    def prepare(self, model, plan: Plan) -> None:
        """Change the model in place for ``plan`` (nothing for storage-only methods)."""

    def restore(self, model) -> None:
        """Undo :meth:`prepare`."""


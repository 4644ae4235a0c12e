"""Modules built with parameters on the meta device: no memory, nothing drawn, while buffers (rotary
frequencies and the like) are computed as usual. Both sides build models this way: a tenant from the
executor's skeleton (client `parameters_on_meta`), the executor a lazy built-in whose unit weights
each rank draws later (base_executor/models.py)."""
from __future__ import annotations

import contextlib

import torch
from torch import nn


@contextlib.contextmanager
def parameters_on_meta(which=None):
    """Inside, every parameter a module registers goes to the meta device, or those `which(param)`
    picks."""
    original = nn.Module.register_parameter

    def register(module, name, param):
        original(module, name, param)
        if param is not None and param.device.type != "meta" and (which is None or which(param)):
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def matrices(param: torch.Tensor) -> bool:
    """The parameters of two or more dimensions: the weights a model's units hold."""
    return param.dim() >= 2

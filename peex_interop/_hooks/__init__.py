"""Hooks and logs: `px.ForwardHook` and `px.BackwardHook` run the engine around a
model's call, and the hooks and logs they apply at each selected call site."""

from ._backward import BackwardHook as BackwardHook
from ._forward import ForwardHook as ForwardHook
from ._hooks import (
    AbstractHook as AbstractHook,
    FunctionHook as FunctionHook,
    HookLike as HookLike,
    HookMap as HookMap,
    IdentityHook as IdentityHook,
)
from ._logs import (
    AbstractLog as AbstractLog,
    FunctionLog as FunctionLog,
    IdentityLog as IdentityLog,
    LogMap as LogMap,
    MeanLog as MeanLog,
    MeanStdLog as MeanStdLog,
    NoneLog as NoneLog,
    plain_containers as plain_containers,
)
from ._wrapper import AbstractHookWrapper as AbstractHookWrapper, selection_fields as selection_fields

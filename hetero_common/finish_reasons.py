"""Finish reasons by name: the one map from `hetero.v1.FinishReason` to the words that logs,
metrics, the in-process engine and the HTTP API use."""

from __future__ import annotations

from hetero.v1 import common_pb2

# A token event or response whose finish_reason is this has not finished.
NOT_FINISHED = common_pb2.FINISH_REASON_UNSPECIFIED


def finish_reason_name(reason: int) -> str:
    """`FINISH_REASON_STOP` -> "stop"; NOT_FINISHED -> "unspecified"."""
    return common_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


def is_finished(reason: int) -> bool:
    return reason != NOT_FINISHED

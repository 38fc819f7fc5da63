"""Waking any subset of waiting processes (or threads) with one system call: a shared-memory doorbell.

A batched env wakes all of its sub-env processes at every step, and the policy server of
AsyncBatchedCollector wakes every worker it answered. Done with one pipe write per process, each
write that wakes a process on the writer's core lets that process preempt the writer, so the
remaining writes wait for it: with 8 sub-envs on 2 cores, the 8 writes took a quarter of the step
(~35 us each). A :class:`Doorbell` instead bumps a sequence number per chosen waiter in shared
memory and wakes them all with one ``futex`` call (``FUTEX_WAKE_BITSET``: each waiter sleeps on the
bit of its index, so only the chosen ones wake); the preemption then happens once, after every
waiter is runnable.

The futex path needs Linux on x86-64, whose stores become visible in program order (the waiter
reads its sequence number without a memory barrier); elsewhere the same class falls back to one
pipe per waiter.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import time
from typing import Iterable

import numpy as np
import torch
import torch.multiprocessing  # noqa: F401  (registers the reductions that share tensors with child processes)

__all__ = ["Doorbell", "futex_available"]

_SYS_FUTEX_X86_64 = 202
_FUTEX_WAIT_BITSET, _FUTEX_WAKE_BITSET = 9, 10
_BITS = 32  # waiters per futex word
_WAKE_ALL = 2**31 - 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _futex_syscall():
    libc = ctypes.CDLL(None, use_errno=True)
    call = libc.syscall
    call.restype = ctypes.c_long
    call.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                     ctypes.c_uint32]
    return call


def futex_available() -> bool:
    """Whether doorbells use futexes here (Linux on x86-64), not pipes."""
    if os.environ.get("RLHARVEST_DOORBELL", "") == "pipe":  # to compare both paths in benchmarks and tests
        return False
    return sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")


class Doorbell:
    """``num_waiters`` numbered waiters; :meth:`ring` wakes any subset of them at once.

    Each waiter has a sequence number in shared memory; ``ring`` bumps those of the chosen waiters
    and wakes them. A waiter remembers the last number it saw and :meth:`wait` returns once its
    number moved (or after ``timeout``), so a ring is never lost, even when the waiter was busy.
    Build it before starting the processes that wait on it (it travels to them as an argument).

    Args:
        ctx: the multiprocessing context (the pipe fallback makes its pipes there).
        num_waiters: how many waiters.

    Example:
        >>> bell = Doorbell(torch.multiprocessing.get_context("fork"), 2)
        >>> bell.ring([1])
        >>> bell.wait(1, seen=0, timeout=1.0), bell.wait(0, seen=0, timeout=0.01)
        (1, 0)
    """

    def __init__(self, ctx, num_waiters: int) -> None:
        self.num_waiters = int(num_waiters)
        self.futex = futex_available()
        self.sequences = torch.zeros(self.num_waiters, dtype=torch.int64).share_memory_()
        self.words = torch.zeros((self.num_waiters + _BITS - 1) // _BITS, dtype=torch.int32).share_memory_()
        self.pipes = [] if self.futex else [ctx.Pipe(duplex=False) for _ in range(self.num_waiters)]
        self._local: dict | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_local": None}

    def _views(self) -> dict:
        """Per-process handles (addresses of the shared words, the syscall): built on first use."""
        if self._local is None:
            words = self.words.numpy()
            self._local = {
                "sequences": self.sequences.numpy(), "words": words,
                "addresses": [self.words.data_ptr() + 4 * index for index in range(words.shape[0])],
                "call": _futex_syscall() if self.futex else None, "timespec": _Timespec(),
            }
        return self._local

    def ring(self, waiters: Iterable[int]) -> None:
        """Wake ``waiters`` (indices): one system call per 32 of them with futexes."""
        local = self._views()
        sequences = local["sequences"]
        waiters = list(waiters)
        masks: dict[int, int] = {}
        for waiter in waiters:
            sequences[waiter] += 1
            masks[waiter // _BITS] = masks.get(waiter // _BITS, 0) | (1 << (waiter % _BITS))
        if not self.futex:
            for waiter in waiters:
                os.write(self.pipes[waiter][1].fileno(), b"\x00")
            return
        words, call = local["words"], local["call"]
        for word, mask in masks.items():
            words[word:word + 1] += 1  # (an array op: wraps around silently) a waiter that read the word before this call does not go to sleep
            call(_SYS_FUTEX_X86_64, local["addresses"][word], _FUTEX_WAKE_BITSET, _WAKE_ALL, None, None, mask)

    def wait(self, waiter: int, seen: int, timeout: float) -> int:
        """Waiter ``waiter``'s sequence number once it differs from ``seen``, or ``seen`` after ``timeout`` s."""
        local = self._views()
        sequences = local["sequences"]
        current = int(sequences[waiter])
        if current != seen:
            return current
        if not self.futex:
            return self._wait_pipe(waiter, seen, timeout, sequences)
        words, call, timespec = local["words"], local["call"], local["timespec"]
        word, bit = waiter // _BITS, 1 << (waiter % _BITS)
        address, deadline = local["addresses"][word], time.monotonic() + timeout
        while True:
            value = int(words[word])
            current = int(sequences[waiter])
            if current != seen:
                return current
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return seen
            # FUTEX_WAIT_BITSET takes an absolute CLOCK_MONOTONIC deadline (time.monotonic's clock)
            timespec.tv_sec, timespec.tv_nsec = int(deadline), int((deadline % 1.0) * 1e9)
            call(_SYS_FUTEX_X86_64, address, _FUTEX_WAIT_BITSET, value, ctypes.byref(timespec), None, bit)

    def _wait_pipe(self, waiter: int, seen: int, timeout: float, sequences: np.ndarray) -> int:
        reader = self.pipes[waiter][0]
        if reader.poll(timeout):
            os.read(reader.fileno(), 64)  # several rings may have queued: the sequence number counts them
        return int(sequences[waiter])

    def waiter_fds(self, waiter: int) -> list[int]:
        """File descriptors that become readable on a ring of ``waiter`` (none with futexes)."""
        return [] if self.futex else [self.pipes[waiter][0].fileno()]

    def close(self) -> None:
        for pair in self.pipes:
            for conn in pair:
                try:
                    conn.close()
                except OSError:
                    pass

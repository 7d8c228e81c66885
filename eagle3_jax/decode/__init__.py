"""Decoding: the jitted loop (prefill, then draft → verify → commit rounds inside one
``lax.while_loop``, for any batch size; ``drafter=None`` is vanilla decoding through the same
loop), ``generate`` over it, and the slot engine of continuous batching.

By role: ``_state`` (the loop's state and inputs), ``_loop`` (prefill, rounds, the jitted
entry), ``_programs`` (``ProgramCache``: compiled programs and their measured round costs),
``_request`` (argument normalisation and validation), ``_measure`` (forced rounds, the
round-cost timer), ``_generate`` (``generate``, its statistics, compile/lower helpers) and
``_slots`` (``Slots``).
"""

from eagle3_jax.decode._generate import GenerateResult, compile_generate, generate, lower_generate, lower_parts
from eagle3_jax.decode._loop import COMPACT_FROM, COMPACT_MIN_NEW_TOKENS, phase_rows
from eagle3_jax.decode._measure import (fastest_rounds, forced_args, forced_call, measure_round_ms, round_costs,
                                        stretch_caps, timed_call)
from eagle3_jax.decode._programs import (COMPILE_CACHE_SIZE, PROGRAMS, ROUND_MS_MEASUREMENTS, ProgramCache,
                                         clear_compiled, keep_compiled)
from eagle3_jax.decode._request import Request, encode_chat, prepare, prompt_rows
from eagle3_jax.decode._slots import Slots, SlotView, lower_slots
from eagle3_jax.decode._state import LoopInputs, LoopStatics
from eagle3_jax.limits import MIN_TEMPERATURE  # generate's smallest temperature but 0 (greedy)

__all__ = [
    "COMPACT_FROM", "COMPACT_MIN_NEW_TOKENS", "COMPILE_CACHE_SIZE", "MIN_TEMPERATURE", "PROGRAMS",
    "ROUND_MS_MEASUREMENTS", "GenerateResult", "LoopInputs", "LoopStatics", "ProgramCache", "Request", "SlotView",
    "Slots", "clear_compiled", "compile_generate", "encode_chat", "fastest_rounds", "forced_args", "forced_call",
    "generate", "keep_compiled", "lower_generate", "lower_parts", "lower_slots", "measure_round_ms", "phase_rows",
    "prepare", "prompt_rows", "round_costs", "stretch_caps", "timed_call",
]

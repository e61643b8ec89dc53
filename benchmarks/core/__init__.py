"""What every benchmark suite shares: one timer (``timing``), the memory counters (``memory``), the built-in data and
models (``data``), one registry of contenders (``contenders``), the phase-timed training step and its rounds
(``phases``, ``rounds``), fresh processes (``processes``) and the long-format CSV + PNG writer (``report``). Nothing
here imports a suite."""

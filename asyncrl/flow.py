"""Flow control: how far generation may run ahead of training (spec, "Staleness" and "Concurrency").

One run's rules, built once from ``StalenessConfig``; the trainer and the rollout worker each hold their side:

- ``FlowControl`` (both sides): whether the run is synchronous (``max_staleness == 0``: generation and training
  take turns, one batch per step), when a sample is too stale to train, the token allowance the trainer grants,
  and how many LoRA adapter versions stay alive. Nothing else decides by ``max_staleness`` (config validation
  checks its range, the console prints it).
- ``WorkerFlow`` (the worker's side, rollout/admission.py): whether a group may start now, under the allowance,
  the cap that follows the server's load (rollout/concurrency.py), the cap that follows the groups' lag
  (rollout/pacing.py) and room in the scoring queue.
- ``ExpiringWait`` (the trainer's step assembler): how long a step may wait for a group still generating at its
  last trainable version.

Every decision that depends on time reads the injected clock (``time.monotonic`` unless a test drives it). This
module imports no other part of asyncrl but the config schema: config validation and the server command read it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # config validation imports this module, and importing the schema first runs asyncrl.config's
    from asyncrl.config.schema import Config  # package init (which validates): the type is all this module needs

Clock = Callable[[], float]


@dataclass(frozen=True)
class FlowControl:
    max_staleness: int
    num_generations: int = 1
    max_concurrent_rollouts: int = 512
    clock: Clock = field(default=time.monotonic, compare=False)
    samples_per_step: int | None = None
    """trainer.samples_per_step: a step's samples; in synchronous mode the worker's batch (``batch_groups``)."""

    @classmethod
    def from_config(cls, config: Config, clock: Clock = time.monotonic) -> FlowControl:
        st = config.staleness
        return cls(st.max_staleness, config.sampling.num_generations, st.max_concurrent_rollouts, clock,
                   config.trainer.samples_per_step)  # fmt: skip

    @property
    def synchronous(self) -> bool:
        """max_staleness=0: every step trains on the weights just synced, so the worker generates one batch, marks
        its end and waits for the sync; nothing is paced, no step waits for expiring groups."""
        return self.max_staleness == 0

    @property
    def batch_groups(self) -> int | None:
        """Synchronous mode with trainer.samples_per_step=N: the groups each batch sends the trainer (N is a whole
        number of groups, plan/assemble.py checks), so every step trains exactly N samples as TRL's batch size
        gives; dropped groups are replaced under the same weights. None: the batch closes at the token allowance,
        and its sample count follows the completions' lengths and the packing ratio."""
        if not self.synchronous or self.samples_per_step is None:
            return None
        return self.samples_per_step // self.num_generations

    # ---- staleness -------------------------------------------------------------------------------------------

    def is_stale(self, sample_version: int, version: int) -> bool:
        """A sample generated under ``sample_version`` is too old to train at ``version``."""
        return version - sample_version > self.max_staleness

    def last_chance_version(self, version: int) -> int:
        """Samples of this policy version train at ``version`` or never (the next sync makes them stale)."""
        return version - self.max_staleness

    # ---- the token allowance (the trainer grants it, the worker admits under it) -----------------------------

    @property
    def allowance_steps(self) -> int:
        """Steps' worth of tokens the worker may hold: the steps a sample may wait, and one in synchronous mode."""
        return max(1, self.max_staleness)

    def initial_allowance(self, rows_per_step: int, token_budget: int) -> int:
        """Before the first step: full rows (blind to the packing ratio, so ``Admission`` drops it at the first
        grant)."""
        return self.allowance_steps * rows_per_step * token_budget

    def allowance(self, consumed: int, forwarded: int, rows_per_step: int, token_budget: int) -> int:
        """The grant after a step that consumed ``consumed`` sample tokens in rows of ``forwarded`` tokens.

        Synchronous mode generates exactly one batch per step, so a step is as large as the allowance: there it
        is the sample tokens that fill the step's rows at the packing ratio just measured (tree rows hold more
        sample tokens than their budget of unique tokens), never the batch itself, which would grow by its own
        overshoot every step."""
        if self.synchronous:
            consumed = int(rows_per_step * token_budget * consumed / max(1, forwarded))
        return self.allowance_steps * max(consumed, 1)

    def grant_before_sync(self) -> bool:
        """Synchronous mode grants before the weight sync (the worker starts the next batch as soon as the
        weights move); asynchronous mode after it, so the groups it lets start run under the new weights."""
        return self.synchronous

    # ---- LoRA adapter versions -------------------------------------------------------------------------------

    @property
    def live_versions(self) -> int:
        """Adapter versions a sample may still be generated under: the current one and max_staleness older."""
        return self.max_staleness + 1

    @property
    def adapter_slots(self) -> int:
        """Adapters the server must hold at once: the live versions, plus the next loaded before the oldest goes."""
        return self.live_versions + 1

    def expiring_wait(self) -> ExpiringWait:
        """The trainer's side of the clock."""
        return ExpiringWait(self.clock)


class ExpiringWait:
    """The trainer's side: a step may wait for a group still generating at its last trainable version rather
    than fill up with younger samples that can wait, for at most the last step's own time (its time less its own
    expiring wait, so the wait does not feed on itself); the first step has no time to go by and waits none."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.waited_s = 0.0
        """This step's time waiting on expiring groups while samples were here to train (sample/expiring_wait_s)."""
        self._step_started: float | None = None
        self._deadline = 0.0

    def start_step(self) -> None:
        now = self.clock()
        previous_s = now - self._step_started - self.waited_s if self._step_started is not None else 0.0
        self._deadline = now + previous_s
        self._step_started, self.waited_s = now, 0.0

    def open(self) -> bool:
        """Whether this step may still wait."""
        return self.clock() < self._deadline

    def held_back(self, since: float) -> None:
        """Count the time from ``since`` (the clock's) as spent waiting with samples here to train."""
        self.waited_s += self.clock() - since

"""Whether an agent-loop entry hands verl its own rewards: decided by its samples.

verl 0.9.1's worker builds ``rm_scores`` only when *every* sample of its batch has a
``reward_score``, scores each sample whose score is None with its own reward loop, and reads
the ``reward_extra_info`` keys of one sample on all others. So the samples of one entry must
agree: either all carry a score (a masked one gets 0.0 and NaN leaves) or none does. Which
one is not guessed from the stage list's shape (a custom stage, a bare function or a ``Judge``
nested in a ``Route`` all write ``artifacts.REWARD``); the samples say it:

- a sample that carries a reward (its ``reward``, or the ``REWARD`` artifact of a masked
  one) says the entry scores; an unmasked one without a reward says it does not; the first
  such sample of the entry in a worker decides, for the worker's lifetime;
- a masked sample without a reward says nothing: its output waits until another sample of
  the entry decides, or until none of them is still running (verl's worker gathers its whole
  batch anyway, so the wait costs no wall time); undecided then, it gets no score;
- the YAML option ``judges: true`` / ``false`` decides up front instead.
"""

from __future__ import annotations

import asyncio


class Scoring:
    """One entry's scoring decision in one worker (its event loop), and who can still make it.

    Args:
        judges: the entry's ``judges`` option: True or False decides; None: the samples do.
    """

    def __init__(self, judges: bool | None) -> None:
        self.fixed = judges
        self.scores: bool | None = judges
        self.running = 0
        self._waiters: list[asyncio.Future[None]] = []

    def started(self) -> None:
        """A sample of the entry started."""
        self.running += 1

    def finished(self, *, carries_reward: bool, masked: bool) -> None:
        """A sample ended; it decides when it carries a reward or ended unmasked.

        Call exactly once per :meth:`started`, before :meth:`decision`.
        """
        self.running -= 1
        if self.scores is None and (carries_reward or not masked):
            self.scores = carries_reward
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    async def decision(self) -> bool | None:
        """Whether the entry scores, once decided or once no other sample can decide it."""
        while self.scores is None and self.running > 0:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        return self.scores

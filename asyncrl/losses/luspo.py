"""LUSPO: GSPO with each sequence's loss scaled by its length, removing GSPO's bias toward short answers."""

from __future__ import annotations

from asyncrl.losses.gspo import GspoOptions, sequence_objective
from asyncrl.losses.policy import LOSSES, PolicyLoss, PolicyView, Terms


@LOSSES.register("luspo")
class Luspo(PolicyLoss):
    """LUSPO (Meituan, arXiv 2602.05261): |o_i| * GSPO's sequence loss, averaged over sequences.

    The GSPO sequence ratio's gradient spreads 1/|o_i| over each token, so long answers get less push per
    token; multiplying by |o_i| (trained tokens of the sequence) restores a per-token weight independent of
    length. Each slot carries |o_i| * loss_i, and normalization=sequence gives (1/G) sum_i |o_i| loss_i, as
    TRL's luspo does.
    """

    Options = GspoOptions
    options: GspoOptions

    def terms(self, view: PolicyView) -> Terms:
        loss, metrics = sequence_objective(view, self.options.epsilon, self.options.epsilon_high)
        return Terms(loss=(view.lengths * loss)[view.slot], metrics=metrics)

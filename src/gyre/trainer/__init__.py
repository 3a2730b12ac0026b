"""Everything one policy update needs: the :class:`Trainer`, batching (``batch``), scoring
(``scoring``), the update (``update``), value models (``critic``), data parallelism
(``distributed``), SFT (``sft``, ``warmstart``)."""

from gyre.trainer.core import Trainer

__all__ = ["Trainer"]

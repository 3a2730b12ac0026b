"""Everything one policy update needs: the :class:`Trainer`, batching (``batch``), scoring
(``scoring``), the update (``update``), value models (``critic``), data parallelism
(``distributed``), the SFT step (``sft``; the SFT loop is :mod:`gyre.sft`)."""

from gyre.trainer.core import Trainer

__all__ = ["Trainer"]

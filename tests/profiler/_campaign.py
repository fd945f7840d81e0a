"""What the campaign tests share: the tiny model, a five-config space on two ranks and its
config keys, and a campaign spec of them."""

from __future__ import annotations

from paratune import get_model
from paratune.profiler.campaign import CampaignSpec
from paratune.space import ConfigSpace

TINY = get_model("tiny")
# Five configs on two ranks: dp2, pp2 under each schedule, tp2 (in that order).
SMALL_SPACE = ConfigSpace(micro_batch_sizes=[2], shardings=["none"], recomputes=["none"])
KEYS_WS2 = ["dp2-tp1-pp1-mb2-gb8-1f1b-v1-none-none",
            "dp1-tp1-pp2-mb2-gb8-gpipe-v1-none-none",
            "dp1-tp1-pp2-mb2-gb8-1f1b-v1-none-none",
            "dp1-tp1-pp2-mb2-gb8-interleaved_1f1b-v2-none-none",
            "dp1-tp2-pp1-mb2-gb8-1f1b-v1-none-none"]


def campaign_spec(**changes) -> CampaignSpec:
    base = dict(model=TINY, world_sizes=(2,), space=SMALL_SPACE, warmup_steps=1,
                measured_steps=2, timeout_s=60.0)
    base.update(changes)
    return CampaignSpec(**base)

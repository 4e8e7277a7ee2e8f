"""fv-rl's plugin module, registered under the ``fv.plugins`` entry point.

Kept light: the method classes (and torch) are imported only when the host asks.
"""

from __future__ import annotations

from typing import Any

from fv_kernel.api import hookimpl


@hookimpl
def fv_register_rl_methods(register: Any) -> None:
    from fv_rl.flow_matching import FlowMatching

    from fv_rl.dmd2 import DMD2
    from fv_rl.grpo import FlowGRPO
    from fv_rl.nft import DiffusionNFT
    from fv_rl.self_forcing import SelfForcing

    register(FlowMatching.name, FlowMatching)
    register(DiffusionNFT.name, DiffusionNFT)
    register(FlowGRPO.name, FlowGRPO)
    register(DMD2.name, DMD2)
    register(SelfForcing.name, SelfForcing)


@hookimpl
def fv_register_rewards(register: Any) -> None:
    from fv_rl.rewards import BrightnessReward, ColourReward, MotionReward, ToyJudgeReward

    for reward in (ColourReward, MotionReward, BrightnessReward, ToyJudgeReward):
        register(reward.name, reward)


@hookimpl
def fv_register_samplers(register: Any) -> None:
    from fv_rl.sde import FlowSDESampler

    register(FlowSDESampler.name, FlowSDESampler)

"""The conditional flow-matching mel decoder shared by CosyVoice2/3 and Chatterbox's S3Gen."""

from mstar.model.flow.cfm import (
    CosineFlowSchedule,
    flow_times,
    guided_velocity,
    noise_table,
    solve_euler,
    velocity_fn,
)
from mstar.model.flow.estimator import (
    EstimatorConfig,
    FlowEstimator,
    chunk_attention_mask,
    estimator_name_map,
    timestep_features,
)
from mstar.model.flow.front import FlowFront, FlowFrontConfig, flow_front_name_map

__all__ = [
    "CosineFlowSchedule",
    "EstimatorConfig",
    "FlowEstimator",
    "FlowFront",
    "FlowFrontConfig",
    "chunk_attention_mask",
    "estimator_name_map",
    "flow_front_name_map",
    "flow_times",
    "guided_velocity",
    "noise_table",
    "solve_euler",
    "timestep_features",
    "velocity_fn",
]

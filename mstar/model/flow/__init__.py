"""The conditional flow-matching mel decoder shared by CosyVoice2/3 and Chatterbox's S3Gen."""

from mstar.model.flow.cfm import CosineFlowSchedule, flow_times, guided_velocity, solve_euler, velocity_fn
from mstar.model.flow.estimator import (
    EstimatorConfig,
    FlowEstimator,
    chunk_attention_mask,
    estimator_name_map,
    timestep_features,
)

__all__ = [
    "CosineFlowSchedule",
    "EstimatorConfig",
    "FlowEstimator",
    "chunk_attention_mask",
    "estimator_name_map",
    "flow_times",
    "guided_velocity",
    "solve_euler",
    "timestep_features",
    "velocity_fn",
]

"""A camera trajectory -> the Plücker rays the DiT is conditioned on.

A request gives one camera-to-world pose per video frame (OpenCV axes: x right, y down, z
forward), ``[F, 4, 4]`` or its top rows ``[F, 3, 4]``, and optionally the intrinsics ``[fx,
fy, cx, cy]`` in pixels of the output size (default: a 60-degree horizontal field of view,
centred). As in the reference, the DiT sees one pose per latent frame (video frames 0, 4, 8,
...; the reference interpolates at exactly those frames), made relative: each to the one before
it (the first: identity), the translations divided by the largest one's length when the camera
moves. Each pixel's ray is its origin (the relative camera position) and its unit direction
turned into that frame; a latent cell's 8 x 8 pixels' rays become its channels, ordered
(ray component, pixel row, pixel column).
"""

from __future__ import annotations

import math

import torch

FRAME_STEP = 4  # video frames a latent frame


def as_poses(values: torch.Tensor) -> torch.Tensor:
    """``[F, 3, 4]`` or ``[F, 4, 4]`` -> ``[F, 4, 4]`` float64 with the last row ``0 0 0 1``."""
    poses = torch.zeros(values.shape[0], 4, 4, dtype=torch.float64)
    poses[:, :3] = values[:, :3].double()
    poses[:, 3, 3] = 1.0
    return poses


def relative_poses(poses: torch.Tensor) -> torch.Tensor:
    """Each pose relative to the previous one (the first: identity), translations normalised
    by the largest one's length when it is positive."""
    return continue_trajectory(poses)[0]


def continue_trajectory(poses: torch.Tensor, last: torch.Tensor | None = None,
                        scale: float = 0.0) -> tuple[torch.Tensor, float]:
    """A stretch of a trajectory, relative: each pose to the one before it (the first to
    ``last``, the pose that ended the trajectory so far; identity when there is none), the
    translations divided by the longest step so far (``scale``, or a longer one of this stretch).
    Returns the relative poses and the new longest step. ``relative_poses`` is the whole
    trajectory in one stretch; a session continues its rollout's trajectory stretch by stretch."""
    chain = poses if last is None else torch.cat([last[None].to(poses), poses])
    out = torch.eye(4, dtype=poses.dtype).repeat(len(chain), 1, 1)
    if len(chain) > 1:
        out[1:] = torch.linalg.solve(chain[:-1], chain[1:])  # previous^-1 @ next
        out[1:, 3] = torch.tensor([0.0, 0.0, 0.0, 1.0], dtype=poses.dtype)
    if last is not None:
        out = out[1:]
    longest = max([float(scale), *out[:, :3, 3].norm(dim=-1).tolist()])
    if longest > 0:
        out[:, :3, 3] /= longest
    return out, longest


def default_intrinsics(width: int, height: int) -> tuple[float, float, float, float]:
    """A 60-degree horizontal field of view, square pixels, the principal point centred."""
    focal = width / (2 * math.tan(math.radians(30)))
    return focal, focal, width / 2, height / 2


def plucker_rays(poses: torch.Tensor, intrinsics: tuple[float, float, float, float], height: int,
                 width: int, cell: tuple[int, int]) -> torch.Tensor:
    """``[F, 4, 4]`` relative poses -> ``[6 * ch * cw, F, height / ch, width / cw]`` float32:
    per pixel (centre at +0.5) its ray origin and unit direction, ``(ch, cw)`` pixels a cell."""
    fx, fy, cx, cy = intrinsics
    poses = poses.double()
    rows = torch.arange(height, dtype=torch.float64) + 0.5
    cols = torch.arange(width, dtype=torch.float64) + 0.5
    y, x = torch.meshgrid((rows - cy) / fy, (cols - cx) / fx, indexing="ij")
    directions = torch.stack([x, y, torch.ones_like(x)], dim=-1)
    directions = directions / directions.norm(dim=-1, keepdim=True)  # [H, W, 3]
    turned = torch.einsum("hwj,fij->fhwi", directions, poses[:, :3, :3])
    origins = poses[:, None, None, :3, 3].expand_as(turned)
    rays = torch.cat([origins, turned], dim=-1)  # [F, H, W, 6]
    f = len(poses)
    ch, cw = cell
    rays = rays.reshape(f, height // ch, ch, width // cw, cw, 6).permute(5, 2, 4, 0, 1, 3)
    return rays.reshape(6 * ch * cw, f, height // ch, width // cw).float()


def trajectory_rays(poses: torch.Tensor, intrinsics: tuple[float, float, float, float] | None, height: int,
                    width: int, cell: tuple[int, int]) -> torch.Tensor:
    """A request's per-video-frame poses -> the rays of its latent frames (``1 + (F - 1) / 4``)."""
    latent = as_poses(poses)[::FRAME_STEP]
    return plucker_rays(relative_poses(latent), intrinsics or default_intrinsics(width, height), height, width, cell)

"""The camera trajectory -> Plücker rays, against the reference's recipe written out with
einops and plain matrix inverses: relative poses frame to frame with normalised translations,
rays per pixel centre, a latent cell's pixels as channels in (ray, row, column) order."""

from __future__ import annotations

import math

import torch
from einops import rearrange

from mstar.model.lingbot.camera import as_poses, continue_trajectory, plucker_rays, relative_poses, trajectory_rays


def random_poses(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, 3, 3, generator=gen, dtype=torch.float64))
    poses = torch.eye(4, dtype=torch.float64).repeat(n, 1, 1)
    poses[:, :3, :3] = q * torch.linalg.det(q).sign()[:, None, None]
    poses[:, :3, 3] = torch.randn(n, 3, generator=gen, dtype=torch.float64)
    return poses


def test_relative_poses_follow_the_reference():
    poses = random_poses(5)
    rel = torch.linalg.inv(poses[:1]) @ poses
    rel[0] = torch.eye(4, dtype=torch.float64)
    want = rel.clone()
    want[1:] = torch.linalg.inv(rel[:-1]) @ rel[1:]
    want[:, :3, 3] /= want[:, :3, 3].norm(dim=-1).max()
    assert torch.allclose(relative_poses(poses), want, atol=1e-12)
    still = relative_poses(torch.eye(4, dtype=torch.float64).repeat(3, 1, 1))
    assert torch.equal(still, torch.eye(4, dtype=torch.float64).repeat(3, 1, 1))


def test_rays_follow_the_reference_layout():
    poses = relative_poses(random_poses(3, 1))
    fx, fy, cx, cy = 7.0, 6.0, 8.5, 5.5
    h, w = 12, 16
    y, x = torch.meshgrid(torch.arange(h, dtype=torch.float64) + 0.5, torch.arange(w, dtype=torch.float64) + 0.5,
                          indexing="ij")
    d = torch.stack([(x - cx) / fx, (y - cy) / fy, torch.ones_like(x)], dim=-1).reshape(-1, 3)
    d = d / d.norm(dim=-1, keepdim=True)
    rays_d = d[None] @ poses[:, :3, :3].transpose(-1, -2)  # [f, h*w, 3]
    rays_o = poses[:, None, :3, 3].expand_as(rays_d)
    emb = torch.cat([rays_o, rays_d], dim=-1).view(3, h, w, 6)
    want = rearrange(emb, "f (h c1) (w c2) c -> (f h w) (c c1 c2)", c1=4, c2=4)
    want = rearrange(want, "(f h w) c -> c f h w", f=3, h=h // 4, w=w // 4).float()
    assert torch.equal(plucker_rays(poses, (fx, fy, cx, cy), h, w, (4, 4)), want)


def test_trajectory_takes_every_fourth_frame_and_3x4_rows():
    poses = random_poses(9, 2)
    rays = trajectory_rays(poses[:, :3], None, 8, 8, (2, 2))
    assert rays.shape == (24, 3, 4, 4)
    assert torch.equal(rays, trajectory_rays(poses, None, 8, 8, (2, 2)))
    assert torch.equal(as_poses(poses[:, :3]), poses)
    focal = 8 / (2 * math.tan(math.radians(30)))
    assert torch.equal(rays, plucker_rays(relative_poses(poses[::4]), (focal, focal, 4, 4), 8, 8, (2, 2)))


def test_a_trajectory_continued_in_stretches_equals_the_whole():
    poses = random_poses(9, seed=3)
    poses[2, :3, 3] += 10.0  # the longest step early on
    whole = relative_poses(poses)
    steps = whole[:, :3, 3].norm(dim=-1)
    cut = int(steps.argmax()) + 1
    assert cut < 5  # the longest step in the first stretch: the same normaliser throughout
    head, scale = continue_trajectory(poses[:cut])
    tail, scale2 = continue_trajectory(poses[cut:], poses[cut - 1], scale)
    assert torch.equal(torch.cat([head, tail]), whole) and scale2 == scale
    # a longer step later rescales only the stretches from then on (the running longest step)
    faster = poses.clone()
    faster[cut:, :3, 3] = faster[cut - 1, :3, 3] + 100 * (faster[cut:, :3, 3] - faster[cut - 1, :3, 3])
    tail, longer = continue_trajectory(faster[cut:], faster[cut - 1], scale)
    assert longer > scale and abs(float(tail[:, :3, 3].norm(dim=-1).max()) - 1.0) < 1e-12

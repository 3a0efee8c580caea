"""``tests/support/host_reads.py`` on a trivial step: each kind of host read is counted once,
at the line that made it; device-side work and ignored sites are not counted."""

from __future__ import annotations

import pytest
import torch

from tests.support.host_reads import HostReads, Read


def _line(marker: str) -> int:
    return next(i for i, text in enumerate(open(__file__).read().splitlines(), 1) if text.endswith(marker))


@pytest.mark.parametrize("inference", [False, True])  # under inference_mode the mode sees other ops
def test_each_host_read_is_counted_at_its_line(inference):
    x = torch.arange(6.0)
    mask = x > 2
    with torch.inference_mode(inference), HostReads() as seen:
        y = torch.where(mask, x, 0.0).cumsum(0) * 2  # device-side work: nothing
        int(x[1])  # item
        if mask.any():  # item
            pass
        x[mask]  # bool index
        x.tolist()  # tolist
        x.cpu()  # cpu
        x.to("cpu", torch.int64)  # to host
        x.to("cpu", non_blocking=True)  # the next blocking read waits for it: nothing
        x.to(x.device)  # the engine's device: nothing
        torch.nonzero(mask)  # nonzero
        torch.unique(torch.tensor([1, 1, 2]))  # unique
        torch.repeat_interleave(torch.tensor([1, 2]))  # repeat_interleave
        torch.repeat_interleave(torch.tensor([1, 2]), output_size=3)  # sized: nothing
        float(x.sum())  # item
        torch.where(mask)  # nonzero
        torch.tensor([1, 2], device=x.device)  # upload
    assert y.shape == (6,)
    whats = [
        "item",
        "item",
        "bool index",
        "tolist",
        "cpu",
        "to host",
        "nonzero",
        "unique",
        "repeat_interleave",
        "item",
        "nonzero",
    ]
    assert [r.what for r in seen.reads] == whats, seen.report()
    for read in seen.reads:
        assert read.site.startswith(__file__) and read.site.endswith("(test_each_host_read_is_counted_at_its_line)")
    where = f"{__file__}:{_line('  # ' + 'bool index')} (test_each_host_read_is_counted_at_its_line)"
    assert Read("bool index", where) in seen.reads
    assert [r.what for r in seen.uploads] == ["upload"] and seen.count() == len(whats)
    assert "bool index" in seen.report()


def test_ignored_sites_and_reads_inside_mstar():
    from mstar.model.eartts.talker import TextTable

    table = TextTable(4, 2)
    with HostReads() as seen:
        table(torch.tensor([1]), torch.ones(1, dtype=torch.bool))
        int(torch.ones(()))
    sites = [r.site for r in seen.reads]
    assert sites[0].startswith("mstar/model/eartts/talker.py:") and sites[0].endswith("(forward)"), seen.report()
    assert sites[1].startswith(__file__)
    with HostReads(ignore=("eartts/talker.py",)) as quiet:
        table(torch.tensor([1]), torch.ones(1, dtype=torch.bool))
    assert quiet.count() == 0

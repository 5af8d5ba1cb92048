"""``LoaderConfig(huge_pages="auto")``: huge pages unless a virtio balloon negotiated free page
reporting, read from sysfs as Linux lists the machine's virtio devices."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember.loaders import LoaderConfig, _config
from ember.loaders.pages import VIRTIO_DEVICES, free_page_reporting

_BALLOON, _NET = "0x0005", "0x0001"
_REPORTING = "0000010000000000000000000000000000000001"  # bit 5 set (and VERSION_1, bit 32)
_NO_REPORTING = "1100000000000000000000000000000000000001"


def _devices(tmp_path: Path, *devices: tuple[str, str]) -> Path:
    for i, (device, features) in enumerate(devices):
        folder = tmp_path / f"virtio{i}"
        folder.mkdir()
        (folder / "device").write_text(device + "\n")
        (folder / "features").write_text(features + "\n")
    return tmp_path


@pytest.mark.parametrize(("devices", "reports"), [
    ([(_BALLOON, _REPORTING)], True),
    ([(_NET, _NO_REPORTING), (_BALLOON, _REPORTING)], True),
    ([(_BALLOON, _NO_REPORTING)], False),
    ([(_NET, _REPORTING)], False),  # bit 5 means something else on another device
    ([], False),
])
def test_free_page_reporting_is_the_balloons_bit_five(
        tmp_path: Path, devices: list[tuple[str, str]], reports: bool) -> None:
    assert free_page_reporting(_devices(tmp_path, *devices)) is reports


def test_a_machine_with_no_virtio_bus_reports_nothing(tmp_path: Path) -> None:
    assert free_page_reporting(tmp_path / "absent") is False


def test_this_machine_is_read_as_its_sysfs_says() -> None:
    """The real sysfs, read independently: a balloon device with bit 5 set."""
    balloons = [d for d in VIRTIO_DEVICES.glob("*")
                if (d / "device").exists() and int((d / "device").read_text(), 16) == 5]
    expected = any((d / "features").read_text()[5:6] == "1" for d in balloons)
    assert free_page_reporting() is expected


@pytest.mark.parametrize("reports", [True, False])
def test_auto_maps_huge_unless_the_host_takes_freed_memory_back(
        monkeypatch: pytest.MonkeyPatch, reports: bool) -> None:
    monkeypatch.setattr(_config, "free_page_reporting", lambda: reports)
    assert LoaderConfig().huge_pages == "auto"
    assert LoaderConfig().maps_huge() is not reports
    assert LoaderConfig(huge_pages=True).maps_huge() is True
    assert LoaderConfig(huge_pages=False).maps_huge() is False

"""Files from outside: a crafted ``.pt2`` is refused, naming the member, before anything in it is
unpickled, extracted or run."""

from __future__ import annotations

import io
import json
import zipfile

import pytest
import torch

from mla_compile import export
from mla_compile.export import UnsafeArchiveError


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


class _Payload:
    """Unpickling this runs code: it writes ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


@pytest.fixture(scope="module")
def program_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("program") / "model.pt2"
    torch.export.save(torch.export.export(_Model(), (torch.randn(2, 3),)), path)
    return path


def _rewritten(source, target, change) -> None:
    """A copy of zip ``source`` at ``target`` with ``change(name, data) -> data | None`` (None:
    the member is left out) applied to every member."""
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(target, "w") as dst:
        for info in src.infolist():
            data = change(info.filename, src.read(info))
            if data is not None:
                dst.writestr(info, data)


def _pickled_payload(marker) -> bytes:
    buffer = io.BytesIO()
    torch.save(_Payload(str(marker)), buffer)
    return buffer.getvalue()


def test_a_clean_program_loads(program_file) -> None:
    program = export.load_program(program_file)
    x = torch.randn(2, 3)
    torch.testing.assert_close(program.module()(x), x @ program.state_dict["weight"])


def test_code_in_the_sample_inputs_never_runs(program_file, tmp_path) -> None:
    """torch.export.load retries sample inputs that the restricted unpickler refuses with the
    unrestricted one, which runs the payload."""
    marker = tmp_path / "ran"
    crafted = tmp_path / "crafted.pt2"
    payload = _pickled_payload(marker)
    _rewritten(program_file, crafted, lambda n, d: payload if "sample_inputs" in n else d)
    with pytest.raises(
        UnsafeArchiveError, match=r"sample_inputs/model\.pt.*unrestricted unpickler"
    ):
        export.load_program(crafted)
    assert not marker.exists()


def test_a_weight_marked_for_pickling_is_refused(program_file, tmp_path) -> None:
    marker = tmp_path / "ran"
    crafted = tmp_path / "crafted.pt2"
    payload = _pickled_payload(marker)

    def change(name: str, data: bytes) -> bytes:
        if name.endswith("model_weights_config.json"):
            config = json.loads(data)
            for meta in config["config"].values():
                meta["use_pickle"] = True
            return json.dumps(config).encode()
        if "/data/weights/weight_" in name:
            return payload
        return data

    _rewritten(program_file, crafted, change)
    with pytest.raises(UnsafeArchiveError, match=r"model_weights_config\.json.*for unpickling"):
        export.load_program(crafted)
    assert not marker.exists()


def test_members_are_bounded_before_they_are_read(program_file, tmp_path) -> None:
    """A highly compressible JSON member (a small file that inflates to gigabytes) is refused
    from its size, not read."""
    crafted = tmp_path / "large.pt2"
    _rewritten(
        program_file, crafted,
        lambda n, d: d + b" " * 300_000 if n.endswith("models/model.json") else d,
    )  # fmt: skip
    with pytest.raises(UnsafeArchiveError, match=r"model\.json.*past the 100000-byte bound"):
        export.load_program(crafted, max_member_bytes=100_000)
    export.load_program(crafted)  # the default bound takes it (trailing spaces are valid JSON)


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("../outside.so", "climbs out"),
        ("pkg/../../outside.so", "climbs out"),
        ("/etc/outside", "absolute"),
        ("pkg\\outside", "backslash"),
    ],
)
def test_package_members_cannot_land_outside(tmp_path, name: str, why: str) -> None:
    package = tmp_path / "crafted.pt2"
    with zipfile.ZipFile(package, "w") as archive:
        archive.writestr("pkg/archive_format", "pt2")
        archive.writestr(name, b"\x7fELF")
    with pytest.raises(UnsafeArchiveError, match=why):
        export.aoti.load_package(package)
    assert not (tmp_path.parent / "outside.so").exists()


def test_a_symbolic_link_member_is_refused(tmp_path) -> None:
    package = tmp_path / "link.pt2"
    with zipfile.ZipFile(package, "w") as archive:
        link = zipfile.ZipInfo("pkg/data/link")
        link.external_attr = (0o120777 << 16) | 0
        archive.writestr(link, "/etc/passwd")
    with pytest.raises(UnsafeArchiveError, match="symbolic link"):
        export.aoti.load_package(package)


def test_not_a_zip(tmp_path) -> None:
    path = tmp_path / "plain.pt2"
    path.write_bytes(b"not a zip")
    with pytest.raises(UnsafeArchiveError, match=r"not a \.pt2"):
        export.load_program(path)

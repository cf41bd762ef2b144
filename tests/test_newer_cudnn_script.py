"""CPU tier: scripts/newer_cudnn.sh, which brings a newer cuDNN to a GPU machine without network in
parts. What needs no network and no GPU: the script parses; ``stash`` then ``install`` on a small
stand-in wheel split as ``fetch`` splits it (the parts joined, the checksum checked, the wheel's
nvidia/cudnn/lib files copied into the folder given); a missing part is refused with exit 3 and
nothing copied; an unknown command exits 2."""

from __future__ import annotations

import hashlib
import os
import pathlib
import subprocess
import zipfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "newer_cudnn.sh"


def _parts(tmp_path) -> pathlib.Path:
    """A stand-in wheel (two libraries, 300 KB of random bytes) split into 100 KB parts."""
    wheel = tmp_path / "nvidia_cudnn_cu13-9.99.0-py3-none-manylinux_2_27_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("nvidia/cudnn/lib/libcudnn.so.9", os.urandom(200_000))
        z.writestr("nvidia/cudnn/lib/libcudnn_ops.so.9", os.urandom(100_000))
        z.writestr("nvidia/cudnn/include/cudnn.h", "/* not copied */")
    parts = tmp_path / ".cudnn-parts"
    parts.mkdir()
    (parts / "wheel.name").write_text(wheel.name + "\n")
    (parts / "wheel.sha256").write_text(hashlib.sha256(wheel.read_bytes()).hexdigest() + "\n")
    subprocess.run(["split", "-b", "100k", "-d", "-a", "2", str(wheel), str(parts / "part-")], check=True)
    return parts


def _script(tmp_path, *args, **env):
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})


def test_the_script_parses_and_refuses_an_unknown_command(tmp_path):
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    done = _script(tmp_path, "upload")
    assert done.returncode == 2 and "unknown command upload" in done.stderr


def test_stash_then_install_copies_the_wheel_s_libraries(tmp_path):
    parts = _parts(tmp_path)
    stash, lib = tmp_path / "stash", tmp_path / "lib"
    lib.mkdir()
    names = sorted(p.name for p in parts.glob("part-*"))
    assert len(names) >= 3
    for name in names:  # one call each on the GPU machine
        assert _script(tmp_path, "stash", f".cudnn-parts/{name}", CUDNN_STASH=str(stash)).returncode == 0
    done = _script(tmp_path, "install", CUDNN_STASH=str(stash), CUDNN_LIB=str(lib))
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in lib.iterdir()) == ["libcudnn.so.9", "libcudnn_ops.so.9"]
    assert "copied 2 files" in done.stdout


def test_a_missing_part_is_refused_and_nothing_is_copied(tmp_path):
    parts = _parts(tmp_path)
    stash, lib = tmp_path / "stash", tmp_path / "lib"
    lib.mkdir()
    for name in sorted(p.name for p in parts.glob("part-*"))[:-1]:  # the last part never arrived
        _script(tmp_path, "stash", f".cudnn-parts/{name}", CUDNN_STASH=str(stash))
    done = _script(tmp_path, "install", CUDNN_STASH=str(stash), CUDNN_LIB=str(lib))
    assert done.returncode == 3 and "missing or damaged" in done.stderr
    assert not list(lib.iterdir())

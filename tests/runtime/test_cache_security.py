"""The cache runs only code this user wrote (docs/reliability.md, "What the cache defends
against"): private folders, entries owned by us and writable by no one else, no shared temp
path, no probe-file race, no writing through a planted symlink."""
import os
import stat
import tempfile
import threading
import warnings
from pathlib import Path

import pytest

import mixc
from mixc.cli import main
from mixc.runtime import cache

OTHER_UID = 12345
as_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                             reason="simulating another owner needs os.chown, which only root may do")


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """A private temp folder and no remembered cache folders or modules."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setattr(cache, "_DIRS", {})
    monkeypatch.setattr(cache, "_BY_PLAN", {})
    monkeypatch.setattr(cache, "_MODULES", {})
    return tmp


def _forget_modules(monkeypatch):
    """As in a fresh process: mixc.load() has imported the module already (op.prepare)."""
    monkeypatch.setattr(cache, "_BY_PLAN", {})
    monkeypatch.setattr(cache, "_MODULES", {})


def _unusable_cache_dir(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("MIXC_CACHE_DIR", str(blocker / "cache"))      # cannot be created, even by root


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_fallback_is_a_private_per_user_folder(fresh, tmp_path, monkeypatch):
    _unusable_cache_dir(tmp_path, monkeypatch)
    with pytest.warns(UserWarning, match="is not writable"):
        d = cache.cache_dir()
    assert d == fresh / f"mixc-cache-{os.geteuid()}"
    st = os.lstat(d)
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and _mode(d) == 0o700
    assert not (fresh / "mixc-cache").exists()


def _plant_symlink(path: Path):
    target = path.parent / "attacker-dir"
    target.mkdir(mode=0o700)
    path.symlink_to(target)


def _plant_open_dir(path: Path):
    path.mkdir()
    os.chmod(path, 0o777)


def _plant_foreign_dir(path: Path):
    path.mkdir(mode=0o700)
    os.chown(path, OTHER_UID, OTHER_UID)


@pytest.mark.parametrize("plant", [_plant_symlink, _plant_open_dir, pytest.param(_plant_foreign_dir, marks=as_root)],
                         ids=["symlink", "mode-777", "other-owner"])
def test_a_planted_fallback_folder_is_not_trusted(fresh, tmp_path, monkeypatch, plant):
    _unusable_cache_dir(tmp_path, monkeypatch)
    planted = fresh / f"mixc-cache-{os.geteuid()}"
    plant(planted)
    with pytest.warns(UserWarning) as caught:
        d = cache.cache_dir()
    assert any("not trusted" in str(w.message) for w in caught)
    assert d != planted and d.parent == fresh and not d.is_symlink()
    assert os.lstat(d).st_uid == os.geteuid() and _mode(d) == 0o700
    mod = cache.load_module(mixc.load("linear_attn").plan())
    assert Path(mod.__file__).parent == d and not list(Path(os.path.realpath(planted)).iterdir())


@as_root
def test_a_cache_folder_of_another_owner_is_not_used(fresh, tmp_path, monkeypatch):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    monkeypatch.setenv("MIXC_CACHE_DIR", str(theirs))
    with pytest.warns(UserWarning, match=f"owned by uid {OTHER_UID}"):
        assert cache.cache_dir() == fresh / f"mixc-cache-{os.geteuid()}"


def test_a_group_writable_cache_folder_is_not_used(fresh, tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o775)
    monkeypatch.setenv("MIXC_CACHE_DIR", str(shared))
    with pytest.warns(UserWarning, match="writable by group or others"):
        assert cache.cache_dir() == fresh / f"mixc-cache-{os.geteuid()}"


def test_no_home_directory_falls_back(fresh, monkeypatch):
    """A uid with no passwd entry and no $HOME (docker --user): Path.home() raises."""
    monkeypatch.delenv("MIXC_CACHE_DIR", raising=False)

    def no_home():
        raise RuntimeError("Could not determine home directory.")
    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    with pytest.warns(UserWarning, match="no home directory"):
        d = cache.cache_dir()
    assert d == fresh / f"mixc-cache-{os.geteuid()}"


def test_threads_never_fall_back(tmp_path, monkeypatch):
    """No probe file shared by the threads of a process: 4 threads x 200 resolutions all get the
    configured folder (with a per-pid probe, 213 of 800 fell back)."""
    monkeypatch.setenv("MIXC_CACHE_DIR", str(tmp_path / "c"))
    got, errors = [], []

    def work():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                got.extend(cache._resolve_cache_dir() for _ in range(200))
        except Exception as err:           # a fallback warning, raised as an error
            errors.append(err)
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and got == [tmp_path / "c"] * 800


def _evil_entry(marker: Path) -> str:
    body = f"open({str(marker)!r}, 'w').write('ran')\n"
    return body + cache._FOOTER + cache._checksum(body) + "\n"      # anyone can compute the footer


def _loosen(path: Path):
    os.chmod(path, 0o666)


def _give_away(path: Path):
    os.chown(path, OTHER_UID, OTHER_UID)


def _symlink_elsewhere(path: Path):
    target = path.parent.parent / "elsewhere.py"
    target.write_text(path.read_text())
    os.chmod(target, 0o600)
    path.unlink()
    path.symlink_to(target)


@pytest.mark.parametrize("spoil", [_loosen, pytest.param(_give_away, marks=as_root), _symlink_elsewhere],
                         ids=["mode-666", "other-owner", "symlink"])
def test_an_entry_not_ours_alone_is_rebuilt_not_run(fresh, tmp_path, monkeypatch, spoil):
    monkeypatch.setenv("MIXC_CACHE_DIR", str(tmp_path / "c"))
    plan = mixc.load("linear_attn").plan()
    path = cache.module_path(plan)
    marker = tmp_path / "PWNED"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_evil_entry(marker))
    spoil(path)
    assert not cache.is_intact(path)
    _forget_modules(monkeypatch)
    mod = cache.load_module(plan)
    assert not marker.exists() and mod.METADATA["mixer"] == "linear_attn"
    assert not path.is_symlink() and os.stat(path).st_uid == os.geteuid() and _mode(path) == 0o600
    assert cache.is_intact(path)


def test_a_directory_in_place_of_an_entry_is_replaced(fresh, tmp_path, monkeypatch):
    monkeypatch.setenv("MIXC_CACHE_DIR", str(tmp_path / "c"))
    plan = mixc.load("linear_attn").plan()
    path = cache.module_path(plan)
    path.unlink(missing_ok=True)
    (path / "inner").mkdir(parents=True)
    _forget_modules(monkeypatch)
    mod = cache.load_module(plan)
    assert path.is_file() and cache.is_intact(path) and mod.METADATA["mixer"] == "linear_attn"


def test_the_module_runs_the_verified_text_not_a_later_file(fresh, tmp_path, monkeypatch):
    """The checked bytes are the ones executed (and the ones Triton's jit reads back)."""
    import inspect
    monkeypatch.setenv("MIXC_CACHE_DIR", str(tmp_path / "c"))
    plan = mixc.load("linear_attn").plan()
    path, text = cache._source(plan)
    mod = cache._import(path, text)
    os.chmod(path, 0o600)
    path.write_text("# changed after the check\n")
    kernel = getattr(mod, mod.METADATA["kernels"]["recurrent_fwd"])
    assert inspect.getsource(kernel.fn) in text


def test_compile_output_replaces_a_symlink_instead_of_writing_through_it(tmp_path, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    out = tmp_path / "out"
    out.mkdir()
    (out / "gla.py").symlink_to(victim)
    assert main(["compile", "gla", "-o", str(out)]) == 0
    assert victim.read_text() == "keep me"
    assert not (out / "gla.py").is_symlink() and "def " in (out / "gla.py").read_text()
    assert _mode(out / "gla.py") == 0o644


def test_the_cache_key_follows_every_stage_below_the_runtime(tmp_path, monkeypatch):
    """A generated module is a function of every stage below the runtime (tests/test_layering.py's
    order): a derive fix (the RWKV-4 output scale) changed the kernels while the key, hashing
    codegen alone, kept serving the old module from a warm cache; then an edit of a class
    unit's macros (mixc/classes/key_diag.j2) was served stale while the key left classes out."""
    import mixc
    from mixc.runtime import cache
    from test_layering import STAGES
    below = STAGES[:STAGES.index("runtime")]
    assert tuple(d.name for d in cache.GENERATOR_DIRS) == below
    plan = mixc.load("gla").plan()
    for d in below:
        (tmp_path / d).mkdir()
        (tmp_path / d / "stage.j2").write_text("x = 1\n")
    monkeypatch.setattr(cache, "PACKAGE_DIR", tmp_path)
    monkeypatch.setattr(cache, "GENERATOR_DIRS", tuple(tmp_path / d for d in below))
    keys = []
    for d in below:
        cache._codegen_fingerprint.cache_clear()
        keys.append(cache.cache_key(plan))
        (tmp_path / d / "stage.j2").write_text("x = 2\n")
    cache._codegen_fingerprint.cache_clear()
    keys.append(cache.cache_key(plan))
    cache._codegen_fingerprint.cache_clear()
    assert len(set(keys)) == len(below) + 1, "an edit in any stage below the runtime must change the key"

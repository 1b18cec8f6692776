"""Pure-Python wheels carried to a machine with no network (bench/wheels/, ignored by git,
filled by bench/fetch_wheels): unpacked into a folder appended to sys.path, so packages the
machine already has take precedence and the rest (fla, lark) come from the wheels."""
from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import zipfile
from pathlib import Path

WHEELS = Path(__file__).resolve().parents[1] / "wheels"


# flash-linear-attention's own wheel holds fla.layers and fla.models, which import transformers;
# the ops are in fla-core. fla imports the layers only when they are there: leave them out.
SKIP = ("flash_linear_attention-",)


def activate(folder: Path = WHEELS) -> dict:
    """Unpack the *.whl of folder (once per set of wheels; not those named in SKIP) and append the
    result to sys.path (and PYTHONPATH, for child processes). An empty or missing folder is not
    an error."""
    wheels = sorted(w for w in folder.glob("*.whl") if not w.name.startswith(SKIP)) if folder.is_dir() else []
    if not wheels:
        return {"wheels": [], "site": None, "note": f"no wheels in {folder} (bench/fetch_wheels fills it)"}
    tag = hashlib.sha256("|".join(f"{w.name}:{w.stat().st_size}" for w in wheels).encode()).hexdigest()[:12]
    site = Path(tempfile.gettempdir()) / f"mixc-bench-site-{tag}"
    if not (site / ".complete").exists():
        tmp = Path(tempfile.mkdtemp(prefix="mixc-bench-site-"))
        for w in wheels:
            with zipfile.ZipFile(w) as z:
                z.extractall(tmp)
        (tmp / ".complete").write_text("\n".join(w.name for w in wheels))
        try:
            os.replace(tmp, site)
        except OSError:                     # another process got there first
            pass
    if str(site) not in sys.path:
        sys.path.append(str(site))
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(site)) if p)
    return {"wheels": [w.name for w in wheels], "site": str(site)}

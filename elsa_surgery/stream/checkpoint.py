"""Resumable runs: finished task ids and the accumulators, saved atomically, refused when they belong to another run.

Layout of ``checkpoint_dir`` (one per rank under ``torch.distributed``: ``rank<r>-of-<w>/``)::

    manifest.json          {"fingerprint": ..., "plan": {...}, "done": [task ids], "generation": g}
    gen-<g>/m.npy S.npy W.npy   the accumulators after exactly the tasks in "done"

A save writes ``gen-<g+1>.tmp/``, renames it to ``gen-<g+1>/``, then writes ``manifest.json.tmp`` and
``os.replace``-s it over the manifest (atomic on POSIX) and only then deletes the older generation: a kill at any
point leaves a manifest that names a complete generation. The fingerprint holds the shapes, dtypes, the settings
that change the result (causal, scale, schedule, c, itr, block, world size, rank) and a SHA-256 of a sample of
token rows of q, k and v; a different fingerprint is refused with an error that names the differing fields.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from .. import monoid

VERSION = 1


def fingerprint(sources, settings: Dict) -> Dict:
    h = hashlib.sha256()
    for s in sources:
        h.update(s.sample_bytes())
    return {"version": VERSION, "shapes": [list(s.shape) for s in sources], "dtypes": [str(s.dtype) for s in sources],
            "settings": settings, "content_sha256": h.hexdigest()}


class Checkpoint:
    def __init__(self, directory, fp: Dict):
        self.dir = Path(directory)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / ".write-probe"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as e:
            raise PermissionError(f"checkpoint_dir={str(directory)!r} is not a writable directory ({e})") from e
        self.fp = fp

    @property
    def manifest(self) -> Path:
        return self.dir / "manifest.json"

    def load(self) -> Optional[Tuple[Dict, List[str], monoid.State]]:
        """``(plan settings, done task ids, accumulator state on the CPU)``, or None for an empty directory."""
        if not self.manifest.exists():
            return None
        man = json.loads(self.manifest.read_text())
        old = man.get("fingerprint", {})
        if old != self.fp:
            diff = sorted(k for k in set(old) | set(self.fp) if old.get(k) != self.fp.get(k))
            if "settings" in diff:
                s_old, s_new = old.get("settings", {}), self.fp["settings"]
                diff += [f"settings.{k}" for k in sorted(set(s_old) | set(s_new)) if s_old.get(k) != s_new.get(k)]
            raise ValueError(f"checkpoint_dir={str(self.dir)!r} holds a checkpoint of a different run (it differs in "
                             f"{', '.join(diff)}); use another directory or delete it to start over")
        gen = self.dir / f"gen-{man['generation']}"
        state = monoid.State(*(torch.from_numpy(np.load(gen / f"{n}.npy")) for n in ("m", "S", "W")))
        return man["plan"], list(man["done"]), state

    def save(self, plan_settings: Dict, done: List[str], state: monoid.State) -> None:
        gen = json.loads(self.manifest.read_text())["generation"] + 1 if self.manifest.exists() else 0
        tmp = self.dir / f"gen-{gen}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for name, t in zip(("m", "S", "W"), state):
            with open(tmp / f"{name}.npy", "wb") as f:
                np.save(f, t.detach().to("cpu").numpy())
                f.flush()
                os.fsync(f.fileno())
        final = self.dir / f"gen-{gen}"
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        man = {"fingerprint": self.fp, "plan": plan_settings, "done": list(done), "generation": gen}
        mtmp = self.dir / "manifest.json.tmp"
        with open(mtmp, "w") as f:
            json.dump(man, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(mtmp, self.manifest)
        for old in self.dir.glob("gen-*"):
            if old.name != final.name:
                shutil.rmtree(old, ignore_errors=True)

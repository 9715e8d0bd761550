"""Run Horovod's PyTorch example scripts, unchanged, against mpiddp.

    python scripts/horovod/horovod_examples.py --horovod /path/to/horovod [--ranks 2] \\
        [--timeout 600]
    python scripts/horovod/horovod_examples.py --horovod /path/to/horovod \\
        --cluster 2x2                                   # across nodes

``/path/to/horovod`` is a checkout of github.com/horovod/horovod; nothing is fetched at run
time. The examples import ``horovod.torch`` (a package that only re-exports mpiddp, as in
``scripts/horovod/horovod_suite.py``) and ``torchvision``. When torchvision is not installed
(its CPU build is not on every package index), a stand-in provides exactly what the examples
use: ``models.resnet18`` (the layout of ``scripts/bench/synthetic_benchmark.py``),
``datasets.MNIST`` reading the real MNIST file format, and
``transforms.Compose/ToTensor/Normalize``.

``pytorch_mnist.py`` trains on data that needs no download: scikit-learn's handwritten digits
(8x8, 1,797 images) scaled to 28x28 and written in MNIST's own idx format, 1,500 images for
training and 297 for testing. Each example runs in its own ``mpiexec`` launch, in its own
process session, killed as a whole at the timeout. Exit status 0 when every example ran to
the end (and ``pytorch_mnist.py`` reached ``--min-accuracy``, with ``--use-adasum`` too: the
Adasum delta optimizer).
"""
from __future__ import annotations

import argparse
import gzip
import os
import re
import signal
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))      # horovod_suite.py, beside it
from horovod_suite import ROOT, make_shim, mpiexec  # noqa: E402

CLUSTER = ROOT / "scripts" / "cluster" / "local_cluster.sh"  # --cluster: the emulated nodes
BENCH = ROOT / "scripts" / "bench"     # synthetic_benchmark.py: the stand-in's ResNet-18

TORCHVISION_STANDIN = {
    "__init__.py": '"""Stand-in for torchvision, made by mpiddp\'s '
                   'scripts/horovod/horovod_examples.py: '
                   'only what Horovod\'s PyTorch examples use."""\n'
                   "from . import datasets, models, transforms  # noqa: F401\n",
    "models.py": "from synthetic_benchmark import ResNet18 as resnet18  # noqa: F401\n",
    "transforms.py": '''import numpy as np
import torch


class Compose:
    def __init__(self, steps):
        self.steps = list(steps)

    def __call__(self, x):
        for step in self.steps:
            x = step(x)
        return x


class ToTensor:
    """uint8 H x W image -> float32 1 x H x W tensor in [0, 1], as torchvision's."""

    def __call__(self, image):
        return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).unsqueeze(0)


class Normalize:
    def __init__(self, mean, std):
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, x):
        return (x - self.mean) / self.std
''',
    "datasets.py": '''import gzip
import os

import numpy as np
import torch


def _read_idx(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


class MNIST(torch.utils.data.Dataset):
    """MNIST from ROOT/MNIST/raw in the original idx format (gzipped or not); never downloads."""

    def __init__(self, root, train=True, transform=None, target_transform=None, download=False):
        raw = os.path.join(os.path.expanduser(root), "MNIST", "raw")
        prefix = "train" if train else "t10k"
        paths = []
        for kind in ("images-idx3-ubyte", "labels-idx1-ubyte"):
            name = os.path.join(raw, prefix + "-" + kind)
            found = [p for p in (name, name + ".gz") if os.path.exists(p)]
            if not found:
                raise RuntimeError(name + " not found, and this stand-in for torchvision does "
                                   "not download: put the MNIST files there")
            paths.append(found[0])
        self.data = _read_idx(paths[0])
        self.targets = torch.from_numpy(_read_idx(paths[1]).astype(np.int64))
        self.transform, self.target_transform = transform, target_transform

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, index):
        image, target = self.data[index], int(self.targets[index])
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target
''',
}


def make_torchvision_standin(directory: Path) -> None:
    package = directory / "torchvision"
    package.mkdir()
    for name, text in TORCHVISION_STANDIN.items():
        (package / name).write_text(text)


def write_idx(path: Path, array: np.ndarray) -> None:
    """MNIST's idx format: 0, 0, dtype code 0x08 (uint8), ndim, big-endian sizes, data."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(struct.pack(">I", n) for n in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def write_digits_as_mnist(data_dir: Path, train_count: int = 1500) -> tuple[int, int]:
    """scikit-learn's 8x8 digits, scaled 3x to 24x24 and padded to MNIST's 28x28, as idx files
    in DATA_DIR/MNIST/raw. Returns (train, test) sizes."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.kron(digits.images, np.ones((3, 3)))            # 0..16, 24x24
    images = np.pad(images, ((0, 0), (2, 2), (2, 2))) * (255.0 / 16.0)
    images = np.rint(images).astype(np.uint8)
    labels = digits.target.astype(np.uint8)
    order = np.random.default_rng(0).permutation(len(labels))
    images, labels = images[order], labels[order]
    raw = data_dir / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    write_idx(raw / "train-images-idx3-ubyte.gz", images[:train_count])
    write_idx(raw / "train-labels-idx1-ubyte.gz", labels[:train_count])
    write_idx(raw / "t10k-images-idx3-ubyte.gz", images[train_count:])
    write_idx(raw / "t10k-labels-idx1-ubyte.gz", labels[train_count:])
    return train_count, len(labels) - train_count


def launcher(ranks: int, cluster: str | None) -> list[str]:
    """The command that starts the ranks: ``mpiexec -n RANKS`` on this machine, or across
    the nodes of an emulated cluster that is up (``scripts/cluster/local_cluster.sh run NxP``)."""
    if cluster is None:
        return [mpiexec(), "-n", str(ranks)]
    return ["bash", str(CLUSTER), "run", cluster, "--"]


def run_example(script: Path, args: list[str], launch: list[str], env: dict, cwd: Path,
                timeout: float) -> tuple[int | None, str]:
    """(exit status or None if it hit the timeout, combined output)."""
    cmd = [*launch, sys.executable, str(script), *args]
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=cwd, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out


def examples(data_dir: Path, quick: bool) -> list[tuple[str, list[str]]]:
    """(example file, arguments) to run; ``quick`` keeps the benchmark to seconds on 2 CPU
    cores (pytorch_mnist.py always runs its 10 epochs: about a minute)."""
    bench = ["--model", "resnet18", "--no-cuda"]
    if quick:
        bench += ["--batch-size", "4", "--num-warmup-batches", "1",
                  "--num-batches-per-iter", "2", "--num-iters", "2"]
    # The digits are 1,500 images, not 60,000: smaller batches give the same number of steps.
    mnist = ["--no-cuda", "--data-dir", str(data_dir), "--batch-size", "16",
             "--log-interval", "20"]
    return [("pytorch_synthetic_benchmark.py", bench),
            ("pytorch_synthetic_benchmark.py", bench + ["--fp16-allreduce"]),
            ("pytorch_mnist.py", mnist),
            ("pytorch_mnist.py", mnist + ["--fp16-allreduce"]),
            ("pytorch_mnist.py", mnist + ["--use-adasum"])]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--horovod", required=True, type=Path, help="a checkout of horovod")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--cluster", metavar="NxP", default=None,
                   help="run across the emulated cluster's nodes instead (N nodes x P ranks; "
                        "as root, after `scripts/cluster/local_cluster.sh up N`; "
                        "docs/multinode.md)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per example launch")
    p.add_argument("--full", action="store_true",
                   help="the examples' own batch counts and epochs (slow on a CPU)")
    p.add_argument("--min-accuracy", type=float, default=80.0,
                   help="pytorch_mnist.py's final test accuracy must reach this (percent)")
    args = p.parse_args(argv)
    if args.cluster is not None:
        match = re.fullmatch(r"([1-9][0-9]*)x([1-9][0-9]*)", args.cluster)
        if match is None:
            p.error(f"--cluster {args.cluster!r}: expected NxP, e.g. 2x2")
        args.ranks = int(match[1]) * int(match[2])
        up = subprocess.run(["bash", str(CLUSTER), "status"], capture_output=True, text=True)
        if up.returncode != 0 or len(up.stdout.splitlines()) < int(match[1]):
            p.error(f"--cluster {args.cluster} needs an emulated cluster of {match[1]} nodes: "
                    f"sudo scripts/cluster/local_cluster.sh up {match[1]} (docs/multinode.md)")
    example_dir = (args.horovod / "examples" / "pytorch").resolve()
    if not (example_dir / "pytorch_mnist.py").exists():
        p.error(f"{example_dir} has no pytorch_mnist.py: --horovod must be a horovod checkout")
    failures = 0
    with tempfile.TemporaryDirectory(prefix="horovod-examples-") as tmp:
        tmp_path = Path(tmp)
        make_shim(tmp_path / "shim", args.horovod)
        paths = [str(tmp_path / "shim"), str(ROOT), str(BENCH)]
        try:
            import torchvision  # noqa: F401
        except ImportError:
            make_torchvision_standin(tmp_path / "shim")
            print("torchvision is not installed: using the stand-in", flush=True)
        train, test = write_digits_as_mnist(tmp_path / "data")
        print(f"MNIST-format digits: {train} training and {test} test images", flush=True)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HOME=str(tmp_path),
                   PYTHONPATH=os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")]))
        if args.ranks > (os.cpu_count() or 1):
            env["MPIR_CVAR_ENABLE_HEAVY_YIELD"] = "1"
        for name, example_args in examples(tmp_path / "data", quick=not args.full):
            status, out = run_example(example_dir / name, example_args,
                                      launcher(args.ranks, args.cluster), env, tmp_path,
                                      args.timeout)
            shown = [line for line in out.splitlines()
                     if re.search(r"Img/sec|Test set|Error|error|Traceback", line)]
            print("\n".join(shown[-8:]) or out[-2000:])
            ok = status == 0
            if ok and name == "pytorch_mnist.py":
                accuracies = re.findall(r"Accuracy: ([0-9.]+)%", out)
                ok = bool(accuracies) and float(accuracies[-1]) >= args.min_accuracy
            verdict = "ok" if ok else ("hung" if status is None else "FAILED")
            print(f"==> {verdict}: {name} {' '.join(example_args)}\n", flush=True)
            failures += not ok
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""Simulated accelerators: real models' parameters on a device that only takes time.

A simulated model has the parameter tensors of a real network (ResNet-50, ResNet-18, VGG-16,
BERT-base; built from shape tables, no torchvision), one simulated layer per real layer in
forward order. A layer's forward and backward *wait* for their share of a one-process step, in
proportion to the layer's multiply-accumulates, and backward writes one element of each
gradient (over memory kept from the first step). The waits are ``time.sleep`` calls: they
release the GIL and use no CPU, as a host thread does while a GPU computes, so a benchmark sees
how mpiddp's host work (hooks, the engine thread, the reductions themselves) fits around a
device that is busy.

What it leaves out: host-device copies (PCIe), the device memory traffic of the reductions and
of the optimizer, kernel launch costs, and any slowdown of the device's compute by concurrent
communication kernels. With CPU tensors, mpiddp packs, reduces and casts the gradients on the
host, as its host-staged transport does for GPU buffers. docs/benchmarks.md, "Simulated
accelerators", has the measurements; the device profiles' sources are in ``PROFILES`` below.

Layer costs are multiply-accumulates (MACs) of one forward pass per sample: what torchvision's
and most papers' "GFLOPs" figures count (ResNet-50 4.1 G at 224x224). Convolutions and linear
layers count in_channels x k x k x out_channels per output position; norms and embeddings one
MAC per output element (their real cost is memory traffic: small next to the convolutions
here). Backward costs the forward's MACs twice: once for the gradient of the weights (in the
attention products, of their second operand), once for the input's gradient, which the first
layer does not need.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn as nn


# ---- shape tables -------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerSpec:
    """One real layer: its parameters (name suffix, shape) and its forward MACs per sample."""
    name: str
    params: tuple
    macs: float


class _Builder:
    """Appends layers in forward order, tracking the activation's spatial size."""

    def __init__(self, size: int = 0):
        self.layers: list[LayerSpec] = []
        self.size = size

    def conv(self, name, cin, cout, k, stride=1, bias=False):
        self.size = (self.size + 2 * (k // 2) - k) // stride + 1
        params = (("weight", (cout, cin, k, k)),) + ((("bias", (cout,)),) if bias else ())
        self.layers.append(LayerSpec(name, params, float(cin * k * k * cout * self.size ** 2)))

    def norm(self, name, channels, elements):
        self.layers.append(LayerSpec(name, (("weight", (channels,)), ("bias", (channels,))),
                                     float(elements)))

    def bn(self, name, channels):
        self.norm(name, channels, channels * self.size ** 2)

    def linear(self, name, cin, cout, rows=1):
        self.layers.append(LayerSpec(name, (("weight", (cout, cin)), ("bias", (cout,))),
                                     float(rows * cin * cout)))

    def pool(self, kernel, stride, padding):
        self.size = (self.size + 2 * padding - kernel) // stride + 1


def resnet(blocks: tuple, bottleneck: bool, image_size: int = 224) -> list[LayerSpec]:
    """torchvision's ResNet layout (v1.5: the stride on the 3x3 convolution)."""
    b = _Builder(image_size)
    b.conv("conv1", 3, 64, 7, 2)
    b.bn("bn1", 64)
    b.pool(3, 2, 1)
    inplanes = 64
    for stage, (planes, count) in enumerate(zip((64, 128, 256, 512), blocks)):
        for i in range(count):
            stride = 2 if stage > 0 and i == 0 else 1
            p = f"layer{stage + 1}.{i}."
            size_in = b.size
            out = planes * (4 if bottleneck else 1)
            if bottleneck:
                b.conv(p + "conv1", inplanes, planes, 1)
                b.bn(p + "bn1", planes)
                b.conv(p + "conv2", planes, planes, 3, stride)
                b.bn(p + "bn2", planes)
                b.conv(p + "conv3", planes, out, 1)
                b.bn(p + "bn3", out)
            else:
                b.conv(p + "conv1", inplanes, planes, 3, stride)
                b.bn(p + "bn1", planes)
                b.conv(p + "conv2", planes, planes, 3)
                b.bn(p + "bn2", planes)
            if stride != 1 or inplanes != out:
                size_out, b.size = b.size, size_in
                b.conv(p + "downsample.0", inplanes, out, 1, stride)
                b.bn(p + "downsample.1", out)
                b.size = size_out
            inplanes = out
    b.linear("fc", inplanes, 1000)
    return b.layers


def vgg16(image_size: int = 224) -> list[LayerSpec]:
    """torchvision's vgg16 (no batch norm): 13 3x3 convolutions with biases, 3 linear."""
    b = _Builder(image_size)
    cin, index = 3, 0
    for item in (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
                 512, 512, 512, "M"):
        if item == "M":
            b.pool(2, 2, 0)
        else:
            b.conv(f"features.{index}", cin, item, 3, bias=True)
            cin = item
        index += 1 if item == "M" else 2        # torchvision numbers the ReLUs too
    b.linear("classifier.0", 512 * 7 * 7, 4096)
    b.linear("classifier.3", 4096, 4096)
    b.linear("classifier.6", 4096, 1000)
    return b.layers


def inception_v3() -> list[LayerSpec]:
    """torchvision's inception_v3 (299x299 images, the auxiliary classifier included, as its
    weights are): convolutions without bias, each with its batch norm; the spatial size of
    every stage written out (its stem's convolutions are unpadded, its 1x7 and 7x1 ones
    keep the size)."""
    layers: list[LayerSpec] = []

    def conv(name, cin, cout, kernel, size):
        kh, kw = kernel if isinstance(kernel, tuple) else (kernel, kernel)
        layers.append(LayerSpec(name + ".conv", (("weight", (cout, cin, kh, kw)),),
                                float(cin * kh * kw * cout * size ** 2)))
        layers.append(LayerSpec(name + ".bn", (("weight", (cout,)), ("bias", (cout,))),
                                float(cout * size ** 2)))

    for name, cin, cout, kernel, size in (("Conv2d_1a_3x3", 3, 32, 3, 149),
                                          ("Conv2d_2a_3x3", 32, 32, 3, 147),
                                          ("Conv2d_2b_3x3", 32, 64, 3, 147),
                                          ("Conv2d_3b_1x1", 64, 80, 1, 73),
                                          ("Conv2d_4a_3x3", 80, 192, 3, 71)):
        conv(name, cin, cout, kernel, size)
    for name, cin, pool in (("Mixed_5b", 192, 32), ("Mixed_5c", 256, 64), ("Mixed_5d", 288, 64)):
        for branch, a, b, kernel in (("branch1x1", cin, 64, 1), ("branch5x5_1", cin, 48, 1),
                                     ("branch5x5_2", 48, 64, 5), ("branch3x3dbl_1", cin, 64, 1),
                                     ("branch3x3dbl_2", 64, 96, 3), ("branch3x3dbl_3", 96, 96, 3),
                                     ("branch_pool", cin, pool, 1)):
            conv(f"{name}.{branch}", a, b, kernel, 35)
    for branch, a, b, kernel, size in (("branch3x3", 288, 384, 3, 17),
                                       ("branch3x3dbl_1", 288, 64, 1, 35),
                                       ("branch3x3dbl_2", 64, 96, 3, 35),
                                       ("branch3x3dbl_3", 96, 96, 3, 17)):
        conv(f"Mixed_6a.{branch}", a, b, kernel, size)
    for name, c7 in (("Mixed_6b", 128), ("Mixed_6c", 160), ("Mixed_6d", 160), ("Mixed_6e", 192)):
        for branch, a, b, kernel in (
                ("branch1x1", 768, 192, 1), ("branch7x7_1", 768, c7, 1),
                ("branch7x7_2", c7, c7, (1, 7)), ("branch7x7_3", c7, 192, (7, 1)),
                ("branch7x7dbl_1", 768, c7, 1), ("branch7x7dbl_2", c7, c7, (7, 1)),
                ("branch7x7dbl_3", c7, c7, (1, 7)), ("branch7x7dbl_4", c7, c7, (7, 1)),
                ("branch7x7dbl_5", c7, 192, (1, 7)), ("branch_pool", 768, 192, 1)):
            conv(f"{name}.{branch}", a, b, kernel, 17)
    conv("AuxLogits.conv0", 768, 128, 1, 5)          # after a 5x5 average pool, stride 3
    conv("AuxLogits.conv1", 128, 768, 5, 1)
    layers.append(LayerSpec("AuxLogits.fc", (("weight", (1000, 768)), ("bias", (1000,))),
                            float(768 * 1000)))
    for branch, a, b, kernel, size in (("branch3x3_1", 768, 192, 1, 17),
                                       ("branch3x3_2", 192, 320, 3, 8),
                                       ("branch7x7x3_1", 768, 192, 1, 17),
                                       ("branch7x7x3_2", 192, 192, (1, 7), 17),
                                       ("branch7x7x3_3", 192, 192, (7, 1), 17),
                                       ("branch7x7x3_4", 192, 192, 3, 8)):
        conv(f"Mixed_7a.{branch}", a, b, kernel, size)
    for name, cin in (("Mixed_7b", 1280), ("Mixed_7c", 2048)):
        for branch, a, b, kernel in (
                ("branch1x1", cin, 320, 1), ("branch3x3_1", cin, 384, 1),
                ("branch3x3_2a", 384, 384, (1, 3)), ("branch3x3_2b", 384, 384, (3, 1)),
                ("branch3x3dbl_1", cin, 448, 1), ("branch3x3dbl_2", 448, 384, 3),
                ("branch3x3dbl_3a", 384, 384, (1, 3)), ("branch3x3dbl_3b", 384, 384, (3, 1)),
                ("branch_pool", cin, 192, 1)):
            conv(f"{name}.{branch}", a, b, kernel, 8)
    layers.append(LayerSpec("fc", (("weight", (1000, 2048)), ("bias", (1000,))),
                            float(2048 * 1000)))
    return layers


def bert_base(seq_len: int = 128, layers: int = 12, hidden: int = 768,
              vocab: int = 30522, classes: int = 2) -> list[LayerSpec]:
    """BERT-base (Hugging Face's module names) with pooler and a classification head; one
    sample is one sequence of ``seq_len`` tokens. The attention products (QK^T and the
    weighted sum of V) have no parameters: a layer of their own."""
    b = _Builder()
    tokens, ffn = seq_len, 4 * hidden
    for name, rows in (("word_embeddings", vocab), ("position_embeddings", 512),
                       ("token_type_embeddings", 2)):
        b.layers.append(LayerSpec(f"embeddings.{name}", (("weight", (rows, hidden)),),
                                  float(tokens * hidden)))
    b.norm("embeddings.LayerNorm", hidden, tokens * hidden)
    for i in range(layers):
        p = f"encoder.layer.{i}."
        for part in ("query", "key", "value"):
            b.linear(p + "attention.self." + part, hidden, hidden, tokens)
        b.layers.append(LayerSpec(p + "attention.scores", (), float(2 * tokens ** 2 * hidden)))
        b.linear(p + "attention.output.dense", hidden, hidden, tokens)
        b.norm(p + "attention.output.LayerNorm", hidden, tokens * hidden)
        b.linear(p + "intermediate.dense", hidden, ffn, tokens)
        b.linear(p + "output.dense", ffn, hidden, tokens)
        b.norm(p + "output.LayerNorm", hidden, tokens * hidden)
    b.linear("pooler.dense", hidden, hidden)          # the first token only
    b.linear("classifier", hidden, classes)
    return b.layers


MODELS: dict[str, Callable[[], list[LayerSpec]]] = {
    "sim-resnet50": lambda: resnet((3, 4, 6, 3), bottleneck=True),
    "sim-resnet18": lambda: resnet((2, 2, 2, 2), bottleneck=False),
    "sim-resnet101": lambda: resnet((3, 4, 23, 3), bottleneck=True),
    "sim-resnet152": lambda: resnet((3, 8, 36, 3), bottleneck=True),
    "sim-vgg16": vgg16,
    "sim-inception3": inception_v3,
    "sim-bert": bert_base,
}
DESCRIPTIONS = {"sim-resnet50": "ResNet-50, 224x224 images", "sim-resnet18":
                "ResNet-18, 224x224 images", "sim-resnet101": "ResNet-101, 224x224 images",
                "sim-resnet152": "ResNet-152, 224x224 images", "sim-vgg16":
                "VGG-16, 224x224 images", "sim-inception3": "Inception V3, 299x299 images",
                "sim-bert": "BERT-base, sequences of 128 tokens"}


def scaled_shape(shape: tuple, param_scale: float) -> tuple:
    """``--param-scale``: the first dimension shrunk (at least 1), the others kept."""
    return (max(1, round(shape[0] * param_scale)),) + tuple(shape[1:])


def param_count(layers: list[LayerSpec], param_scale: float = 1.0) -> int:
    return sum(math.prod(scaled_shape(shape, param_scale))
               for layer in layers for _, shape in layer.params)


def forward_macs(layers: list[LayerSpec]) -> float:
    return sum(layer.macs for layer in layers)


def train_macs(layers: list[LayerSpec]) -> float:
    """Forward + backward MACs per sample, as the simulated layers charge them: backward is
    twice the forward, less the first layer's input gradient (the data needs none)."""
    return 3 * forward_macs(layers) - layers[0].macs


# ---- device profiles ----------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceProfile:
    """A GPU's measured ResNet-50 training throughput (one GPU) and memory bandwidth; other
    models run at the same MACs per second (an estimate, printed as such), or at their own
    measured rate where the profile has one (``measured``: model -> images per second)."""
    name: str
    resnet50_images_per_s: float
    memory_gb_per_s: float
    source: str
    measured: dict = field(default_factory=dict)


_DLE = ("NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/README.md, "
        "'Training performance results', 1 GPU, pytorch-21.03 NGC container")
PROFILES = {p.name: p for p in (
    DeviceProfile("v100-fp32", 367, 900, _DLE + ", DGX-1 V100 16GB, FP32"),
    DeviceProfile("v100-amp", 1200, 900, _DLE + ", DGX-1 V100 16GB, mixed precision"),
    DeviceProfile("a100-tf32", 938, 2039, _DLE + ", DGX A100 80GB, TF32"),
    DeviceProfile("a100-amp", 2470, 2039, _DLE + ", DGX A100 80GB, mixed precision"),
    # The GPUs of Horovod's paper (Pascal) under TensorFlow: VGG-16 runs at 2.6x the MACs
    # per second of ResNet-50 there, so each model has its own rate.
    DeviceProfile("p100-tf-fp32", 219, 732,
                  "TensorFlow's benchmarks page (tensorflow/docs_src/performance/"
                  "benchmarks.md, May 2017), DGX-1 P100, 1 GPU, synthetic data, batch 64, "
                  "FP32", {"sim-resnet152": 91.8, "sim-vgg16": 154, "sim-inception3": 142}),
)}


def profile_step_time(profile: DeviceProfile, layers: list[LayerSpec], batch: int,
                      model: str = "sim-resnet50") -> float:
    """One process's step on ``profile`` for ``batch`` samples of ``layers``: the training
    MACs per second measured for ``model`` (``layers``' own, or the nearest relative the
    profile measured), else ResNet-50's, applied to ``layers``' training MACs."""
    reference = model if model in profile.measured else "sim-resnet50"
    images_per_s = profile.measured.get(reference, profile.resnet50_images_per_s)
    rate = images_per_s * train_macs(MODELS[reference]())
    return batch * train_macs(layers) / rate


# ---- the simulated device -----------------------------------------------------------------
class SimulatedDevice:
    """The timeline of one accelerator, as seen from the host thread that drives it.

    ``submit(seconds)`` queues that much device work; ``wait()`` sleeps (GIL released, no
    CPU) until the queued work is done. Host work between the two (writing gradients)
    overlaps the device's, as with a real asynchronous launch.

    A real host launches kernels ahead of its device, so the device does not idle while the
    host runs Python between layers. Here the host waits for every layer, so work submitted
    up to ``LOOKAHEAD`` seconds after the device ran out of work still starts when the
    device became free: that covers ``time.sleep``'s late wake-ups (about 0.1 ms here, more
    on a loaded machine) and the host's work between layers (autograd, hooks: tens of
    microseconds). A longer gap (the host waiting for the network, a host-bound stretch that
    has used up the allowance) leaves the device idle for all but ``LOOKAHEAD``.
    """

    LOOKAHEAD = 1e-3

    def __init__(self):
        self.free_at = 0.0      # time.perf_counter() when the queued work ends
        self.busy = 0.0         # device seconds submitted so far

    def submit(self, seconds: float) -> None:
        if seconds > 0:
            self.busy += seconds
            self.free_at = max(self.free_at, time.perf_counter() - self.LOOKAHEAD) + seconds

    def wait(self) -> None:
        left = self.free_at - time.perf_counter()
        if left > 0:
            time.sleep(left)

    def run(self, seconds: float) -> None:
        self.submit(seconds)
        self.wait()


class _Layer(torch.autograd.Function):
    """Forward and backward of one simulated layer: waits on the device, a cheap gradient."""

    @staticmethod
    def forward(ctx, x, layer, *params):
        for p in params:
            # A torch call on each parameter, as a real layer's kernels make: lets whatever
            # watches parameter use (mpiddp's forward overlap) see it. No data is touched.
            p.detach()
        layer.device.run(layer.forward_s)
        ctx.layer = layer
        # Kept for backward, as a real layer keeps its weights (its input gradient needs
        # them): sharded parameters (stage 3) are gathered again there.
        ctx.save_for_backward(*params)
        return x.clone()           # a new (batch, 1) activation: the graph links the layers

    @staticmethod
    def backward(ctx, grad):
        layer = ctx.layer
        assert len(ctx.saved_tensors) == len(layer.params)   # read, as a real layer reads them
        input_grad = ctx.needs_input_grad[0]
        layer.device.submit(layer.forward_s * (2 if input_grad else 1))
        grads = [layer.gradient(i, p) for i, p in enumerate(layer.params)]
        layer.device.wait()      # the gradients are final when the device is done
        return (grad if input_grad else None, None, *grads)


class SimulatedLayer(nn.Module):
    def __init__(self, spec: LayerSpec, device: SimulatedDevice, param_scale: float,
                 grad_value: float):
        super().__init__()
        self.spec, self.device, self.grad_value = spec, device, grad_value
        self.forward_s = 0.0
        for suffix, shape in spec.params:
            # --param-scale: fewer bytes to reduce; the time stays the real layer's.
            param = nn.Parameter(torch.full(scaled_shape(shape, param_scale), 0.01))
            param.sim_elements = math.prod(shape)      # the real layer's, for the optimizer
            self.register_parameter(suffix, param)

        self.storages: dict[int, torch.UntypedStorage] = {}

    @property
    def params(self) -> list:
        return list(self.parameters(recurse=False))

    def gradient(self, index: int, param: torch.Tensor) -> torch.Tensor:
        """A new gradient tensor for ``param``, at almost no host cost: a GPU writes its
        gradients itself. The first one is filled; later ones reuse its memory (a fresh,
        unreferenced tensor over it, which autograd takes as the gradient without a copy)
        and write one element, so no host time goes into faulting in and filling memory."""
        storage = self.storages.get(index)
        if storage is None or param.grad is not None:    # first step, or accumulating
            grad = torch.empty_like(param).fill_(self.grad_value)
            if param.grad is None:
                self.storages[index] = grad.untyped_storage()
            return grad
        grad = torch.empty(0, dtype=param.dtype).set_(storage, 0, param.shape)
        grad.view(-1)[:1].fill_(self.grad_value)
        return grad

    def forward(self, x):
        return _Layer.apply(x, self, *self.params)


class SimulatedModel(nn.Module):
    """A real model's parameters on a ``SimulatedDevice``: the input is a (batch, 1) tensor
    (its values do not matter), the output another; train on ``output.sum()``."""

    def __init__(self, name: str, param_scale: float = 1.0):
        super().__init__()
        if name not in MODELS:
            raise ValueError(f"unknown simulated model {name!r}: use one of {sorted(MODELS)}")
        if not 0 < param_scale <= 1:
            raise ValueError(f"param_scale must be in (0, 1], not {param_scale}")
        self.model_name, self.specs = name, MODELS[name]()
        self.device = SimulatedDevice()
        # The real layer names ('.' is not allowed in a module name): stall reports and
        # timelines name real layers.
        self.layers = nn.ModuleDict(
            (spec.name.replace(".", "_"),
             SimulatedLayer(spec, self.device, param_scale, 1e-3 * (1 + i % 7)))
            for i, spec in enumerate(self.specs))
        self.optimizer_s = 0.0

    def set_step_time(self, step_s: float, batch: int, optimizer_s: float = 0.0) -> None:
        """Scale the layers so that one process's step (forward, backward and optimizer
        step) on ``batch`` samples takes ``step_s`` seconds of device time, of which the
        optimizer step ``optimizer_s``."""
        if optimizer_s >= step_s:
            raise ValueError(f"the optimizer's {optimizer_s:.4f} s leave nothing of a "
                             f"{step_s:.4f} s step")
        per_mac = (step_s - optimizer_s) / (batch * train_macs(self.specs))
        for layer in self.layers.values():
            layer.forward_s = batch * layer.spec.macs * per_mac
        self.optimizer_s = optimizer_s

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
        return x


class SimulatedOptimizer(torch.optim.Optimizer):
    """An optimizer step that only takes device time: ``seconds_per_param`` for each
    element of the real model's parameters that have a gradient (``--param-scale`` does not
    shorten it; a real optimizer's update is memory-bound);
    the parameters stay as they are. It steps on whatever ``param_groups`` hold at the call,
    so a partial step (mpiddp's forward overlap updates a few parameters at a time) takes
    its share."""

    def __init__(self, params, device: SimulatedDevice, seconds_per_param: float):
        super().__init__(params, {})
        self.device, self.seconds_per_param = device, seconds_per_param

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None):
        loss = closure() if closure is not None else None
        elements = sum(getattr(p, "sim_elements", p.numel()) for group in self.param_groups
                       for p in group["params"] if p.grad is not None)
        self.device.run(elements * self.seconds_per_param)
        return loss


OPTIMIZER_BYTES_PER_PARAM = 20   # SGD with momentum in fp32: read p, g, m; write p, m


def optimizer_seconds_per_param(memory_gb_per_s: float) -> float:
    return OPTIMIZER_BYTES_PER_PARAM / (memory_gb_per_s * 1e9)

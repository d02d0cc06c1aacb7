"""Worker for test_zero3_live_parameters: one process, a ZeRO-3 engine over a 4-layer tiny llama (every
parameter partitioned at rest, a prefetch bucket of about one layer, as DeepSpeed's 5e7 is at 0.5B),
3 micro-batches of forward + backward; prints, per micro-batch, how many parameter elements were gathered
when the backward started.

  python zero3_live_worker.py posttrain   (posttrain's limits: numel / 8 here)
  python zero3_live_worker.py deepspeed   (DeepSpeed's defaults, 1e9)
"""
import os
import sys

import torch

os.environ.setdefault("DS_BUILD_OPS", "0")
from engines_common import tiny_llama, train_engine  # noqa: E402

import posttrain.engines.deepspeed_engine as ds_engine  # noqa: E402
from posttrain.engines.dist import shutdown

ds_engine.LIVE_PARAMETERS_MIN = 1  # numel / 8 of this tiny model
make = ds_engine.ds_config


def config(**kwargs):
    cfg = make(**kwargs)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # partition every parameter
    cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = 10_000
    if sys.argv[1] == "deepspeed":
        del cfg["zero_optimization"]["stage3_max_live_parameters"], \
            cfg["zero_optimization"]["stage3_max_reuse_distance"]
    return cfg


ds_engine.ds_config = config


def main() -> None:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    torch.set_num_threads(1)
    model = tiny_llama(0)
    model.config.num_hidden_layers = 4
    model = type(model)(model.config).float()
    engine = train_engine(model, total_steps=2, zero_stage=3, lr=1e-3)
    module = engine.model.module
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    total = sum(p.ds_numel for p in module.parameters())
    for _ in range(3):
        loss = engine.model(input_ids=ids).logits.float().logsumexp(-1).mean()
        held = sum(p.ds_numel for p in module.parameters() if p.ds_status == ZeroParamStatus.AVAILABLE)
        engine.model.backward(loss)
        print(f"gathered {held} of {total}", flush=True)


if __name__ == "__main__":
    main()
    shutdown()  # no gloo thread left alive at exit (an exit-time abort otherwise)

"""An accelerate evaluation loop under torchrun (CPU, gloo).

``bad``: only the main process gathers the predictions (``gather_for_metrics`` is a collective);
the other rank goes on to ``wait_for_everyone``. ``good``: every rank gathers, the main process
prints.
"""

import datetime
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from torch.utils.data import DataLoader, TensorDataset


def main(bug: bool) -> None:
    timeout = datetime.timedelta(seconds=20)
    accelerator = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=timeout)])
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    data = TensorDataset(torch.randn(32, 8), torch.randint(0, 2, (32,)))
    loader = DataLoader(data, batch_size=4)
    model, loader = accelerator.prepare(model, loader)
    model.eval()
    correct = 0
    with torch.no_grad():
        for x, y in loader:
            pred = model(x).argmax(-1)
            if bug:
                if accelerator.is_main_process:  # (guard)
                    pred, y = accelerator.gather_for_metrics((pred, y))  # BUG: a collective on one rank
                    correct += int((pred == y).sum())
            else:
                pred, y = accelerator.gather_for_metrics((pred, y))
                if accelerator.is_main_process:
                    correct += int((pred == y).sum())
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        print(f"correct: {correct}")
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1:] == ["bad"])

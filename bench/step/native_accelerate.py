"""Plain Accelerate, as a competent user writes it (cpu=True so gloo runs the job on a CPU machine)."""
import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

from common import main

accelerator = None


def init():
    global accelerator
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    return accelerator.process_index, accelerator.num_processes


def make_step(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
    model, optimizer = accelerator.prepare(model, optimizer)

    def step(batch):
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
    return step


def gather(v):
    return gather_object([v])


if __name__ == "__main__":
    main("native", "accelerate", init, make_step, gather, finish=lambda: accelerator.end_training())

"""Plain Accelerate, as a competent user writes it (cpu=True so gloo runs the job on a CPU machine)."""
import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

from common import model_and_batches, parse_args, report, run_steps

args = parse_args()
accelerator = Accelerator(cpu=not torch.cuda.is_available())
model, batches = model_and_batches(args, accelerator.process_index, accelerator.num_processes)
optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
model, optimizer = accelerator.prepare(model, optimizer)


def step(batch):
    with accelerator.accumulate(model):
        loss = model(**batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()


median, times = run_steps(step, batches, args.warmup)
report(args, "native", "accelerate", accelerator.process_index, accelerator.num_processes, median, times,
       lambda v: gather_object([v]))

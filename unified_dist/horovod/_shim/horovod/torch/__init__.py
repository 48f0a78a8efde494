"""``horovod.torch`` answered by :mod:`unified_dist.horovod` (see :mod:`unified_dist.horovod.redirect`)."""
import sys

import unified_dist.horovod as _api

sys.modules[__name__] = _api  # first: what follows may look horovod.torch up

import unified_dist.horovod.elastic as _elastic  # noqa: E402

sys.modules["horovod.torch.elastic"] = _elastic

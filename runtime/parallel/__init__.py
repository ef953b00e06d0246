"""Model parallelism on a device mesh: tensor parallel, FSDP2 over the data-parallel ranks, and
pipeline stages, as the job's degrees (:mod:`hpc.contract.parallel`) say.

* :mod:`runtime.parallel.mesh`: the ``DeviceMesh`` of the job's degrees, and where a rank sits in it;
* :mod:`runtime.parallel.apply`: what ``Session.wrap`` does to a model on that mesh (a TP plan
  with ``parallelize_module``, then FSDP2 over the data-parallel dimensions);
* :mod:`runtime.parallel.grads`: gradient-norm clipping over parameters that live on different
  meshes (TP-split and replicated ones), which ``torch.nn.utils.clip_grad_norm_`` refuses;
* :mod:`runtime.parallel.pipeline`: a model cut into stages with ``torch.distributed.pipelining``.
"""

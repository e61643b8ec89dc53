"""What every op family shares: ``call`` (``run_op`` and the autograd Function), ``problem`` (what every backend
receives), ``checks`` (the arguments' rules), ``spec`` (the InfoNCE softmax over the candidate layout), ``backend``
(the registry and "auto"), ``host_read`` (the one host synchronisation), ``precision`` and ``gemm`` (the precision
policy and the one TF32 read), ``bands`` (Matryoshka band arithmetic), ``limits`` and ``result``."""

"""Entry points: the ``fastinfer`` command line (:mod:`.cli`: generate, bench, quantize, eval),
held-out perplexity (:mod:`.eval`) and ``make demo`` (:mod:`.demo`). They sit on top of everything
else and only use public names of the packages below them."""

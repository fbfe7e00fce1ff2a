import sys

from fastinfer.simt import main

sys.exit(main())

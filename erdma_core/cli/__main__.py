import os
import sys

from .main import main

os.environ.setdefault("PYTHONUNBUFFERED", "1")
sys.exit(main())

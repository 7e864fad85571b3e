"""``python -m ds_ext.cluster``: ``ds-ext cluster`` without importing the rest of ds_ext."""

import sys

from ds_ext.cluster.command import main

sys.exit(main())

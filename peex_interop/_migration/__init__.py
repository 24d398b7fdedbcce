"""Migration between implementations of one network: aligning their layers, comparing
them layer by layer, renaming logs, and porting or transferring parameters."""

from ._align import align as align
from ._alignment import Alignment as Alignment
from ._compare import compare as compare
from ._comparison import Comparison as Comparison, ComparisonRow as ComparisonRow
from ._port import port as port
from ._rename import rename as rename
from ._transfer import transfer_params as transfer_params

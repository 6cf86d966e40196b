import sys
from .demo import main
main(sys.argv[2:])

from common.process import exit_without_teardown
from worker.worker import main

exit_without_teardown(main())

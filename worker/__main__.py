from worker.worker import main

main()

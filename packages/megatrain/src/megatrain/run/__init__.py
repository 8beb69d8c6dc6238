"""Running training: joining the job (`distributed`), building a rank's state (`setup`), one
iteration (`step`), the loop with its logging, saving and stopping (`loop`), the launcher
behind `megatrain run` (`launch`), metrics and the run log (`metrics`), the learning-rate
schedule (`lr_schedule`) and how a failed collective is explained (`failures`)."""

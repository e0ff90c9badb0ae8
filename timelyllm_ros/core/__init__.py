"""The scheduling core: the time-utility model, tasks and generations, the events the
scheduler reports, the queue, priorities, admission, engine requests and the scheduler loop."""

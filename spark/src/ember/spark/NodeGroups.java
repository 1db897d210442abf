package ember.spark;

import java.util.ArrayList;
import java.util.HashMap;
import java.util.HashSet;
import java.util.Iterator;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.TreeMap;
import java.util.TreeSet;

import org.apache.spark.NarrowDependency;
import org.apache.spark.Partition;
import org.apache.spark.SparkEnv;
import org.apache.spark.api.java.JavaRDD;
import org.apache.spark.api.java.function.FlatMapFunction;
import org.apache.spark.rdd.PartitionCoalescer;
import org.apache.spark.rdd.PartitionGroup;
import org.apache.spark.rdd.RDD;
import org.apache.spark.scheduler.TaskLocation;
import org.apache.spark.sql.Dataset;
import org.apache.spark.sql.Row;
import org.apache.spark.sql.catalyst.InternalRow;
import org.apache.spark.storage.BlockId;
import org.apache.spark.storage.BlockManagerId;
import org.apache.spark.storage.RDDBlockId;
import org.apache.spark.storage.StorageLevel;

import scala.Option;

/**
 * The feeding job of {@code Cluster.train()}: one task per fed node, which
 * feeds that node's partitions one after the other.
 *
 * <p>Why: partition {@code p} of a call goes to node {@code p % nodes}, or
 * to the node its call's routes name ({@code routes[p % routes.length]}, the
 * same in every epoch: {@code ember._routing}).  With
 * one task per partition, Spark may run two partitions of node 0 at once while
 * node 1 has no feeder; under a synchronous strategy node 0 then stops
 * consuming (it waits in an all-reduce for node 1) and every feeding task
 * blocks.  Grouped, each node has exactly one feeder for the whole call,
 * whatever Spark's scheduler does.
 *
 * <p>The grouping is a {@link PartitionCoalescer} (no shuffle): group
 * {@code i} holds the parent partitions {@code idx} with
 * {@code (first + idx)} routed to node {@code i}, in increasing order, which
 * {@code CoalescedRDD} computes one after the other.
 *
 * <p>Each group prefers the location most of its partitions prefer (for
 * cached data, the executor caching their blocks), a different one for each
 * group, so that the feeders read locally and no two of them wait for the
 * same core.  A group that would carry no location of its own would take
 * its first parent partition's (Spark's scheduler looks through narrow
 * dependencies): two groups whose first partitions are cached on one
 * executor then both prefer it, and with one core there the second waits
 * {@code spark.locality.wait} before it runs elsewhere (docs/performance.md,
 * bench-train).  A group whose preferred executors the others took prefers
 * that executor's host instead.  Preferring the fed node's host for every
 * group removed the wait too, but read most cached blocks remotely, which
 * cost more on 2 cores.
 */
public final class NodeGroups implements PartitionCoalescer, ScalaSerializable {
  private static final long serialVersionUID = 1L;

  private final int nodes;
  private final int first;
  private final int expected;
  private final int[] routes;

  /**
   * @param nodes the fed nodes (groups)
   * @param first the call's number of the parent's partition 0
   * @param expected the parent's partitions, as the driver counted them (a
   *     mismatch would route partitions to the wrong node: fail instead)
   * @param routes the node of each of the data's partitions, every epoch
   *     (null or empty: round-robin)
   */
  public NodeGroups(int nodes, int first, int expected, int[] routes) {
    if (nodes < 1) {
      throw new IllegalArgumentException("ember: NodeGroups needs at least one node");
    }
    this.nodes = nodes;
    this.first = first;
    this.expected = expected;
    this.routes = routes == null || routes.length == 0 ? null : routes.clone();
    if (this.routes != null) {
      for (int n : this.routes) {
        if (n < 0 || n >= nodes) {
          throw new IllegalArgumentException("ember: a route to node " + n + " of " + nodes);
        }
      }
    }
  }

  /** The group (fed node) of the parent's partition {@code idx}. */
  private int groupOf(int idx) {
    long p = first + (long) idx;
    return routes == null ? (int) (p % nodes) : routes[(int) (p % routes.length)];
  }

  @Override
  public PartitionGroup[] coalesce(int maxPartitions, RDD<?> parent) {
    Partition[] parts = parent.partitions();
    if (parts.length != expected) {
      throw new IllegalStateException("ember: the data has " + parts.length
          + " partitions where train() counted " + expected);
    }
    String[] where = placements(parent, parts.length);
    PartitionGroup[] groups = new PartitionGroup[nodes];
    for (int i = 0; i < nodes; i++) {
      groups[i] = new PartitionGroup(Option.apply(where[i]));
    }
    for (int idx = 0; idx < parts.length; idx++) {
      // $plus$eq is ArrayBuffer's += in Scala 2.12 and 2.13 (2.12 has no addOne)
      groups[groupOf(idx)].partitions().$plus$eq(parts[idx]);
    }
    return groups;
  }

  /**
   * Each group's preferred location (null: none): greedily, the (group,
   * location) pair with the most of that group's partitions preferring it,
   * among the groups still without one and the locations no group took yet;
   * then each group left without one prefers the host of its most preferred
   * location.  Locations are the scheduler's strings ({@link TaskLocation}):
   * an executor for a cached block, a host for a file's block.
   */
  private String[] placements(RDD<?> parent, int count) {
    List<Map<String, Integer>> votes = new ArrayList<>();
    for (int i = 0; i < nodes; i++) {
      votes.add(new TreeMap<>());  // sorted: the same data, the same choice
    }
    Map<Integer, List<List<String>>> cached = new HashMap<>();
    for (int idx = 0; idx < count; idx++) {
      Map<String, Integer> group = votes.get(groupOf(idx));
      for (String where : locations(parent, idx, cached, new HashSet<>())) {
        group.merge(where, 1, Integer::sum);
      }
    }
    String[] where = new String[nodes];
    Set<String> taken = new HashSet<>();
    for (int round = 0; round < nodes; round++) {
      int bestGroup = -1;
      String best = null;
      int most = 0;
      for (int g = 0; g < nodes; g++) {
        if (where[g] != null) {
          continue;
        }
        for (Map.Entry<String, Integer> e : votes.get(g).entrySet()) {
          if (e.getValue() > most && !taken.contains(e.getKey())) {
            most = e.getValue();
            best = e.getKey();
            bestGroup = g;
          }
        }
      }
      if (best == null) {
        break;
      }
      where[bestGroup] = best;
      taken.add(best);
    }
    for (int g = 0; g < nodes; g++) {
      if (where[g] == null && !votes.get(g).isEmpty()) {
        Map.Entry<String, Integer> top = null;
        for (Map.Entry<String, Integer> e : votes.get(g).entrySet()) {
          if (top == null || e.getValue() > top.getValue()) {
            top = e;
          }
        }
        where[g] = TaskLocation.apply(top.getKey()).host();
      }
    }
    return where;
  }

  /**
   * Where partition {@code idx} of {@code rdd} is best computed, as the
   * DAGScheduler decides it (getPreferredLocsInternal): the executors caching
   * its block, else the partition's own preferred hosts, else the first
   * answer through its narrow dependencies.  The cached blocks are asked of
   * the BlockManagerMaster here, not through {@code
   * SparkContext.getPreferredLocs}: that answers from the scheduler's cache
   * of block locations, which still says "nowhere" for data cached by the
   * job just before (the scheduler clears it when the next job is submitted,
   * and a job's partitions, so this coalescer, are computed before that).
   *
   * @param cached block locations already asked, by RDD id (one ask per RDD)
   */
  private static List<String> locations(RDD<?> rdd, int idx,
                                        Map<Integer, List<List<String>>> cached,
                                        Set<String> visited) {
    if (!visited.add(rdd.id() + ":" + idx)) {
      return List.of();
    }
    if (!rdd.getStorageLevel().equals(StorageLevel.NONE())) {
      List<String> blocks = cachedBlocks(rdd, cached).get(idx);
      if (!blocks.isEmpty()) {
        return blocks;
      }
    }
    List<String> own = new ArrayList<>();
    var preferred = rdd.preferredLocations(rdd.partitions()[idx]).iterator();
    while (preferred.hasNext()) {
      own.add(preferred.next());
    }
    if (!own.isEmpty()) {
      return own;
    }
    var deps = rdd.dependencies().iterator();
    while (deps.hasNext()) {
      Object dep = deps.next();
      if (dep instanceof NarrowDependency) {
        NarrowDependency<?> narrow = (NarrowDependency<?>) dep;
        var parents = narrow.getParents(idx).iterator();
        while (parents.hasNext()) {
          List<String> found = locations(narrow.rdd(), (Integer) parents.next(), cached, visited);
          if (!found.isEmpty()) {
            return found;
          }
        }
      }
    }
    return List.of();
  }

  /** Each partition's cached block locations, as the scheduler writes them. */
  private static List<List<String>> cachedBlocks(RDD<?> rdd,
                                                 Map<Integer, List<List<String>>> cached) {
    return cached.computeIfAbsent(rdd.id(), id -> {
      int n = rdd.partitions().length;
      BlockId[] ids = new BlockId[n];
      for (int i = 0; i < n; i++) {
        ids[i] = new RDDBlockId(id, i);
      }
      var answer = SparkEnv.get().blockManager().master().getLocations(ids);
      List<List<String>> out = new ArrayList<>();
      for (int i = 0; i < n; i++) {
        List<String> here = new ArrayList<>();
        var managers = answer.apply(i).iterator();
        while (managers.hasNext()) {
          BlockManagerId bm = managers.next();
          here.add(TaskLocation.apply(bm.host(), bm.executorId()).toString());
        }
        out.add(here);
      }
      return out;
    });
  }

  static <T> RDD<T> group(RDD<T> rdd, int nodes, int first, int expected, int[] routes) {
    NodeGroups coalescer = new NodeGroups(nodes, first, expected, routes);
    return rdd.coalesce(nodes, false, Option.<PartitionCoalescer>apply(coalescer), null);
  }

  /**
   * The hosts holding each of {@code rdd}'s partitions {@code 0..count-1}, as
   * the scheduler would place them (the executors caching a block, else the
   * partition's preferred hosts, through narrow dependencies): what the
   * driver chooses a call's routes from.
   */
  public static String[][] hosts(RDD<?> rdd, int count) {
    Map<Integer, List<List<String>>> cached = new HashMap<>();
    String[][] out = new String[count][];
    for (int idx = 0; idx < count; idx++) {
      Set<String> hosts = new TreeSet<>();
      for (String where : locations(rdd, idx, cached, new HashSet<>())) {
        hosts.add(TaskLocation.apply(where).host());
      }
      out[idx] = hosts.toArray(new String[0]);
    }
    return out;
  }

  /**
   * A DataFrame's rows ({@code queryExecution().toRdd()}), for {@link #hosts}
   * and {@link #groupRows}: made once, as making them may run the plan's
   * shuffles (adaptive execution).
   */
  public static RDD<InternalRow> rowsOf(Dataset<Row> df) {
    return Plans.rows(df);
  }

  /**
   * A PySpark RDD's JVM side (pickled batches, or strings) grouped per node;
   * each parent partition begins with a null element, which PySpark's stream
   * to the Python feeding task carries as its NULL length: the start of the
   * next partition (neither a pickle nor a text line is ever null).
   */
  public static JavaRDD<Object> groupPython(JavaRDD<Object> rdd, int nodes, int first,
                                            int expected, int[] routes) {
    JavaRDD<Object> marked = rdd.mapPartitions(new MarkStart<Object>(), true);
    return JavaRDD.fromRDD(group(marked.rdd(), nodes, first, expected, routes),
                           marked.classTag());
  }

  /**
   * A DataFrame grouped per node.  Its rows must say their partition
   * (Spark's {@code spark_partition_id()} in a column): Arrow batches span
   * the partitions of a group.
   */
  public static Dataset<Row> groupRows(Dataset<Row> df, RDD<InternalRow> rows, int nodes,
                                       int first, int expected, int[] routes) {
    // rows ({@link #rowsOf} df) are read one at a time downstream (RDDScanExec
    // projects each before the next), so toRdd's reuse of its row objects is harmless
    RDD<InternalRow> grouped = group(rows, nodes, first, expected, routes);
    return Plans.frame(df, grouped, df.schema());
  }

  /** Puts a null element before a partition's elements. */
  static final class MarkStart<T> implements FlatMapFunction<Iterator<T>, T> {
    private static final long serialVersionUID = 1L;

    @Override
    public Iterator<T> call(Iterator<T> it) {
      return new Iterator<T>() {
        private boolean started;

        @Override
        public boolean hasNext() {
          return !started || it.hasNext();
        }

        @Override
        public T next() {
          if (!started) {
            started = true;
            return null;
          }
          return it.next();
        }
      };
    }
  }
}

package ember.spark;

import java.util.Iterator;

import org.apache.spark.Partition;
import org.apache.spark.api.java.JavaRDD;
import org.apache.spark.api.java.function.FlatMapFunction;
import org.apache.spark.rdd.PartitionCoalescer;
import org.apache.spark.rdd.PartitionGroup;
import org.apache.spark.rdd.RDD;
import org.apache.spark.sql.Dataset;
import org.apache.spark.sql.Row;
import org.apache.spark.sql.catalyst.InternalRow;

import scala.Option;

/**
 * The feeding job of {@code Cluster.train()}: one task per fed node, which
 * feeds that node's partitions one after the other.
 *
 * <p>Why: partition {@code p} of a call goes to node {@code p % nodes}.  With
 * one task per partition, Spark may run two partitions of node 0 at once while
 * node 1 has no feeder; under a synchronous strategy node 0 then stops
 * consuming (it waits in an all-reduce for node 1) and every feeding task
 * blocks.  Grouped, each node has exactly one feeder for the whole call,
 * whatever Spark's scheduler does.
 *
 * <p>The grouping is a {@link PartitionCoalescer} (no shuffle): group
 * {@code i} holds the parent partitions {@code idx} with
 * {@code (first + idx) % nodes == i}, in increasing order, which
 * {@code CoalescedRDD} computes one after the other.
 *
 * <p>The groups carry no preferred location of their own, so Spark's
 * scheduler gives each the location of its first parent partition that has
 * one: for cached data, the executor caching it.  That keeps the feeder's
 * reads local, but two groups whose first partitions are cached on one
 * executor both prefer it, and with one core there the second waits
 * {@code spark.locality.wait} before it runs elsewhere (docs/performance.md,
 * bench-train).  Preferring the fed node's host instead removed that wait
 * but read most cached blocks remotely, which cost more on 2 cores.
 */
public final class NodeGroups implements PartitionCoalescer, ScalaSerializable {
  private static final long serialVersionUID = 1L;

  private final int nodes;
  private final int first;
  private final int expected;

  /**
   * @param nodes the fed nodes (groups)
   * @param first the call's number of the parent's partition 0
   * @param expected the parent's partitions, as the driver counted them (a
   *     mismatch would route partitions to the wrong node: fail instead)
   */
  public NodeGroups(int nodes, int first, int expected) {
    if (nodes < 1) {
      throw new IllegalArgumentException("ember: NodeGroups needs at least one node");
    }
    this.nodes = nodes;
    this.first = first;
    this.expected = expected;
  }

  @Override
  public PartitionGroup[] coalesce(int maxPartitions, RDD<?> parent) {
    Partition[] parts = parent.partitions();
    if (parts.length != expected) {
      throw new IllegalStateException("ember: the data has " + parts.length
          + " partitions where train() counted " + expected);
    }
    PartitionGroup[] groups = new PartitionGroup[nodes];
    for (int i = 0; i < nodes; i++) {
      groups[i] = new PartitionGroup(Option.<String>empty());
    }
    for (int idx = 0; idx < parts.length; idx++) {
      // $plus$eq is ArrayBuffer's += in Scala 2.12 and 2.13 (2.12 has no addOne)
      groups[(int) ((first + (long) idx) % nodes)].partitions().$plus$eq(parts[idx]);
    }
    return groups;
  }

  static <T> RDD<T> group(RDD<T> rdd, int nodes, int first, int expected) {
    NodeGroups coalescer = new NodeGroups(nodes, first, expected);
    return rdd.coalesce(nodes, false, Option.<PartitionCoalescer>apply(coalescer), null);
  }

  /**
   * A PySpark RDD's JVM side (pickled batches, or strings) grouped per node;
   * each parent partition begins with a null element, which PySpark's stream
   * to the Python feeding task carries as its NULL length: the start of the
   * next partition (neither a pickle nor a text line is ever null).
   */
  public static JavaRDD<Object> groupPython(JavaRDD<Object> rdd, int nodes, int first,
                                            int expected) {
    JavaRDD<Object> marked = rdd.mapPartitions(new MarkStart<Object>(), true);
    return JavaRDD.fromRDD(group(marked.rdd(), nodes, first, expected), marked.classTag());
  }

  /**
   * A DataFrame grouped per node.  Its rows must say their partition
   * (Spark's {@code spark_partition_id()} in a column): Arrow batches span
   * the partitions of a group.
   */
  public static Dataset<Row> groupRows(Dataset<Row> df, int nodes, int first, int expected) {
    // rows are read one at a time downstream (RDDScanExec projects each
    // before the next), so toRdd's reuse of its row objects is harmless
    RDD<InternalRow> grouped = group(Plans.rows(df), nodes, first, expected);
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
